"""Kernel → library attribution, from a table of real kernel names.

Every name below is copied from the A100 traces in tests/data/kineto/
(the op is the one that launched it there), except where marked.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mltrace.run.events import Span
from mltrace.run.levels import Level
from mltrace.run.store import Run
from mltrace.tracer.passes.gpu_library import attribute_gpu_library, gpu_library_of

CUTLASS_GEMM = (
    "void cutlass::Kernel<cutlass_80_tensorop_s1688gemm_128x128_32x5_tn_align4>"
    "(cutlass_80_tensorop_s1688gemm_128x128_32x5_tn_align4::Params)"
)

TABLE: list[tuple[str, str | None, str]] = [
    # cuDNN
    ("cudnn_ampere_scudnn_128x64_relu_xregs_large_nn_v1", "aten::cudnn_convolution", "cuDNN"),
    ("void cask_cudnn::computeOffsetsKernel<false, false>(cask_cudnn::ComputeOffsetsParams)", None, "cuDNN"),
    (
        "void cudnn::ops::nchwToNhwcKernel<float, float, float, false, true, (cudnnKernelDataType_t)2>"
        "(cudnn::ops::nchw2nhwc_params_t<float>, float const*, float*)",
        None,
        "cuDNN",
    ),
    (
        "sm80_xmma_fprop_implicit_gemm_indexed_tf32f32_tf32f32_f32_nhwckrsc_nchw_tilesize128x128x16_stage4"
        "_warpsize2x2x1_g1_tensor16x8x8_alignc4_execute_kernel_cudnn",
        None,
        "cuDNN",
    ),
    (
        "void fft2d_r2c_32x32<float, false, 5u, true>(float2*, float const*, int, int, int, int, int, int, int, int, "
        "int, cudnn::reduced_divisor, bool, int2, int, int)",
        None,
        "cuDNN",
    ),
    # a cuBLAS-family GEMM run by cuDNN: the op decides
    ("ampere_gcgemm_64x64_nt", "aten::cudnn_convolution", "cuDNN"),
    ("ampere_gcgemm_64x64_nt", None, "cuBLAS"),
    # cuBLAS
    ("ampere_sgemm_32x32_sliced1x4_tn", "aten::addmm", "cuBLAS"),
    ("ampere_sgemm_128x128_tt", "aten::bmm", "cuBLAS"),
    (
        "void gemvNSP_kernel<float, float, float, float, 1, 32, 4, 1024, cublasGemvParams<cublasGemvTensorStridedBatched"
        "<float const>, cublasGemvTensorStridedBatched<float const>, cublasGemvTensorStridedBatched<float>, float> >"
        "(cublasGemvParams<cublasGemvTensorStridedBatched<float const>, cublasGemvTensorStridedBatched<float const>, "
        "cublasGemvTensorStridedBatched<float>, float>)",
        "aten::mm",
        "cuBLAS",
    ),
    (
        "void splitKreduce_kernel<float, float, float, float, true, false, false>(cublasSplitKParams<float>, float const*, "
        "float const*, float*, float const*, float const*, float const*, float const*, float*, void*, long, float*, int*)",
        "aten::mm",
        "cuBLAS",
    ),
    (
        "void sgemm_largek_lds64<true, true, 6, 3, 4, 5, 2, 66>(float*, float const*, float const*, int, int, int, int, int, "
        "int, float const*, float const*, float, float, int, int, int*, int*)",
        "aten::addmm",
        "cuBLAS",
    ),
    (
        "void scal_kernel<float, float, 1, false, 6, 5, 5, 3>(cublasTransposeParams<float>, float const*, float*, float const*)",
        "aten::addmm",
        "cuBLAS",
    ),
    # cuBLASLt
    (
        "void epilogue::impl::globalKernel<float, float, float, true, true>(int, int, long, float*, cublasLtEpilogue_t, "
        "int, float*, long, void*, long, long, long, float*, long, float const*, float const*, long)",
        "aten::addmm",
        "cuBLASLt",
    ),
    # CUTLASS kernels shipped inside cuBLAS: launched by aten::mm they are cuBLAS's
    (CUTLASS_GEMM, "aten::mm", "cuBLAS"),
    (CUTLASS_GEMM, None, "CUTLASS"),
    # Triton (TorchInductor)
    ("triton_poi_fused_add_cos_sin_0", "triton_poi_fused_add_cos_sin_0", "Triton"),
    # NCCL
    ("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)", "record_param_comms", "NCCL"),
    # PyTorch native
    (
        "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<int>, at::detail::Array<char*, 1> >"
        "(int, at::native::FillFunctor<int>, at::detail::Array<char*, 1>)",
        None,
        "PyTorch native",
    ),
    (
        "void at::native::(anonymous namespace)::max_pool_forward_nchw<float, float>(int, float const*, long, long, long, "
        "int, int, int, int, int, int, int, int, int, int, float*, long*)",
        None,
        "PyTorch native",
    ),
    (
        "void at_cuda_detail::cub::DeviceScanInitKernel<at_cuda_detail::cub::ScanTileState<long, true> >"
        "(at_cuda_detail::cub::ScanTileState<long, true>, int)",
        "aten::cumsum",
        "PyTorch native",
    ),
    (
        "void (anonymous namespace)::softmax_warp_forward<float, float, float, 1, false, false>(float*, float const*, int, int, "
        "int, bool const*, int, bool)",
        "aten::_softmax",
        "PyTorch native",
    ),
    ("void compute_cuda_kernel<long>(long*, long*, long*, long, long)", "aten::repeat_interleave", "PyTorch native"),
    # FBGEMM
    ("void fbgemm_gpu::permute_2D_lengths_kernel<int>(int, int, int const*, int const*, int*)", None, "FBGEMM"),
    (
        "void bounds_check_indices_kernel<long, false>(at::GenericPackedTensorAccessor<long, 1ul, at::RestrictPtrTraits, int>, "
        "at::GenericPackedTensorAccessor<long, 1ul, at::RestrictPtrTraits, int>, long, at::GenericPackedTensorAccessor<long, "
        "1ul, at::RestrictPtrTraits, int>, long, at::GenericPackedTensorAccessor<long, 1ul, at::RestrictPtrTraits, int>)",
        "fbgemm::bounds_check_indices",
        "FBGEMM",
    ),
    # CUB (outside PyTorch's copy)
    (
        "void cub::DeviceScanInitKernel<cub::ScanTileState<int, true> >(cub::ScanTileState<int, true>, int)",
        "fbgemm::asynchronous_complete_cumsum",
        "CUB",
    ),
    # other
    (
        "void linearize_index_kernel<long>(at::GenericPackedTensorAccessor<long, 1ul, at::RestrictPtrTraits, int>)",
        "torch::autograd::CppNode<SplitLookupFunction_rowwise_adagrad_Op>",
        "other",
    ),
    ("my_custom_kernel", None, "other"),  # not from the traces: an unknown name with no op
]


@pytest.mark.parametrize(("kernel", "op", "library"), TABLE)
def test_gpu_library_of(kernel: str, op: str | None, library: str) -> None:
    assert gpu_library_of(kernel, op) == library


def test_attribute_gpu_library_uses_the_launching_op() -> None:
    gemm = "ampere_gcgemm_64x64_nt"
    spans = [
        Span(1, None, Level.OP, "aten::cudnn_convolution", 0, 100, 1, {"ml.op.name": "aten::cudnn_convolution"}),
        Span(2, 1, Level.KERNEL, "cudaLaunchKernel", 10, 20, 1, {"cuda.api.name": "cudaLaunchKernel"}),
        Span(3, 2, Level.KERNEL, gemm, 30, 40, 2, {"gpu.kernel.name": gemm}),
        Span(4, None, Level.KERNEL, gemm, 50, 60, 2, {"gpu.kernel.name": gemm}),  # no launch known
        Span(5, None, Level.KERNEL, "k", 70, 80, 2, {"gpu.kernel.name": "k", "ml.library.name": "MyLib"}),
        Span(6, None, Level.KERNEL, "Memcpy HtoD (Pageable -> Device)", 80, 90, 2, {"gpu.activity": "gpu_memcpy"}),
    ]
    run = Run(path=Path("."), meta={}, spans=spans)
    out = attribute_gpu_library(run)
    libs = {s.id: s.attrs.get("ml.library.name") for s in out.spans}
    assert libs == {1: None, 2: None, 3: "cuDNN", 4: "cuBLAS", 5: "MyLib", 6: None}
    assert out.meta["correlation"]["attribute_gpu_library"] == {"cuBLAS": 1, "cuDNN": 1}
    assert "ml.library.name" not in spans[2].attrs  # the input run is untouched
