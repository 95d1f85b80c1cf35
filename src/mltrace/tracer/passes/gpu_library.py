"""Which library a GPU kernel belongs to, from its name (and its op).

CUPTI reports kernels by their (demangled) names only; the names carry the library in their
namespace, prefix or parameter types. ``gpu_library_of`` names it from a kernel's name and,
for GEMM kernels that several libraries share, the op that launched it;
``attribute_gpu_library`` sets ``ml.library.name`` on every kernel span of a run.
"""

from __future__ import annotations

import re

from mltrace.run.events import Span
from mltrace.run.levels import Level
from mltrace.run.store import Run

CUDNN = "cuDNN"
CUBLAS = "cuBLAS"
CUBLASLT = "cuBLASLt"
CUTLASS = "CUTLASS"
TRITON = "Triton"
NCCL = "NCCL"
PYTORCH = "PyTorch native"
FBGEMM = "FBGEMM"
CUB = "CUB"
OTHER = "other"

# Checked in order: the first match wins. Definite markers come before the
# generic GEMM families, because cuDNN and cuBLASLt kernels contain "gemm" too.
_DEFINITE: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"nccl", re.I), NCCL),
    (re.compile(r"^triton_|^triton__"), TRITON),
    (re.compile(r"cudnn|implicit_convolve_sgemm|explicit_convolve_sgemm|wgrad_alg\d|dgrad_engine|bn_fw_|bn_bw_", re.I), CUDNN),
    (re.compile(r"cublasLt", re.I), CUBLASLT),
    (re.compile(r"cublas", re.I), CUBLAS),
    (re.compile(r"\bat::native::|\bat_cuda_detail::|\bc10::|\bpytorch_flash::|^void \(anonymous namespace\)::softmax_warp"), PYTORCH),
    (re.compile(r"fbgemm|split_embedding"), FBGEMM),
)
#: Library-neutral GEMM families: the op that launched them decides.
_GENERIC: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"cutlass", re.I), CUTLASS),
    (re.compile(r"^(ampere|volta|turing|maxwell|sm\d+)_\w*gemm|^void sgemm_|^void gemmk1_|^void gemv|^nvjet_|^sm\d+_xmma_gemm"), CUBLAS),
)
_CUB = re.compile(r"(?<![\w:])cub::")

#: Ops whose GPU work goes through cuBLAS / cuBLASLt.
_BLAS_OPS = re.compile(r"^aten::(mm|addmm|bmm|baddbmm|addbmm|matmul|linear|addmv|mv|dot|vdot|_addmm_activation)$")
#: Ops whose GPU work goes through cuDNN.
_CUDNN_OPS = re.compile(r"^aten::_?cudnn_")


def gpu_library_of(kernel_name: str, op_name: str | None = None) -> str:
    """Names the library a GPU kernel comes from.

    The patterns come from real A100 traces (tests/data/kineto/, PyTorch 2.0–2.5):

    ================ =====================================================================
    cuDNN            ``cudnn`` anywhere: ``cudnn_ampere_scudnn_128x64_relu_xregs_large_nn_v1``,
                     ``void cudnn::ops::nchwToNhwcKernel<…>``, ``cask_cudnn::computeOffsetsKernel``,
                     ``sm80_xmma_fprop_implicit_gemm_…_execute_kernel_cudnn``,
                     ``fft2d_r2c_32x32<…>(…, cudnn::reduced_divisor, …)``; also cuDNN's
                     classic names ``implicit_convolve_sgemm``, ``wgrad_alg0_engine``,
                     ``bn_fw_inf_1C11_kernel_NCHW``
    cuBLASLt         ``cublasLt``: ``void epilogue::impl::globalKernel<…>(…, cublasLtEpilogue_t, …)``
    cuBLAS           ``cublas`` in the parameter types (``gemvNSP_kernel<…cublasGemvParams…>``,
                     ``splitKreduce_kernel<…>(cublasSplitKParams<float>, …)``,
                     ``scal_kernel<…>(cublasTransposeParams<float>, …)``); the SASS GEMM
                     families ``ampere_sgemm_32x128_tn``, ``ampere_gcgemm_64x64_nt``,
                     ``sgemm_largek_lds64``, ``gemmk1_kernel``, ``sm80_xmma_gemm_…``,
                     ``nvjet_…`` (cuBLAS 12.6+)
    CUTLASS          ``cutlass``: ``void cutlass::Kernel<cutlass_80_tensorop_s1688gemm_128x128_32x5_tn_align4>``
    Triton           ``triton_`` prefix (TorchInductor: ``triton_poi_fused_add_cos_sin_0``)
    NCCL             ``nccl``: ``ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(…)``, ``ncclDevKernel_…``
    PyTorch native   ``at::native::``, ``at_cuda_detail::`` (PyTorch's copy of CUB),
                     ``c10::``, ``pytorch_flash::``, PyTorch's persistent softmax
                     (``(anonymous namespace)::softmax_warp_forward``)
    FBGEMM           ``fbgemm_gpu::``, ``split_embedding_…``
    CUB              ``cub::`` outside PyTorch's namespace (``cub::DeviceScanKernel<…>``)
    other            anything else; when the launching op is known, an unrecognised
                     kernel of a cuDNN or BLAS op takes that library, of another
                     ``aten::`` op "PyTorch native" (``compute_cuda_kernel<long>`` under
                     ``aten::repeat_interleave``), of an ``fbgemm::`` op "FBGEMM"
    ================ =====================================================================

    The name alone cannot tell who called a shared GEMM kernel: cuBLAS ships
    CUTLASS-generated kernels (every ``cutlass::Kernel`` in the sample trace was
    launched by ``aten::mm``/``addmm``/``bmm``, i.e. through cuBLAS) and cuDNN
    runs cuBLAS's SASS GEMMs (``ampere_gcgemm_64x64_nt`` under
    ``aten::cudnn_convolution``). So the launching op, when known, decides
    for those generic names.

    Args:
        kernel_name: the kernel's demangled name as CUPTI reports it.
        op_name: the framework op that launched it (``aten::mm``), if known;
            it decides for generic GEMM kernels that several libraries share.

    Returns:
        One of "cuDNN", "cuBLAS", "cuBLASLt", "CUTLASS", "Triton", "NCCL",
        "PyTorch native", "FBGEMM", "CUB", "other".
    """
    for pattern, lib in _DEFINITE:
        if pattern.search(kernel_name):
            return lib
    for pattern, lib in _GENERIC:
        if pattern.search(kernel_name):
            if op_name:
                if _CUDNN_OPS.match(op_name):
                    return CUDNN
                if _BLAS_OPS.match(op_name):
                    return CUBLAS
            return lib
    if _CUB.search(kernel_name):
        return CUB
    if op_name:
        # An unrecognised kernel takes the library its op is known to use;
        # other aten ops launch PyTorch's own kernels.
        if _CUDNN_OPS.match(op_name):
            return CUDNN
        if _BLAS_OPS.match(op_name):
            return CUBLAS
        if op_name.startswith("aten::"):
            return PYTORCH
        if op_name.startswith("fbgemm::"):
            return FBGEMM
    return OTHER


def _op_of(span: Span, by_id: dict[int, Span]) -> str | None:
    """The name of the nearest op-level ancestor (kernel → launch call → op)."""
    cur = by_id.get(span.parent_id) if span.parent_id is not None else None
    for _ in range(64):  # bounded: a cyclic parent chain must not hang the pass
        if cur is None:
            return None
        if cur.level is Level.OP:
            name = cur.attrs.get("ml.op.name", cur.name)
            return name if isinstance(name, str) else cur.name
        cur = by_id.get(cur.parent_id) if cur.parent_id is not None else None
    return None


def _kernel_rows(spans: list[Span]) -> list[int]:
    """Rows of the spans with a ``gpu.kernel.name`` (a str): in C (``_sweep.str_rows``) where
    it is built, so that a run with no GPU work costs next to nothing here."""
    from mltrace.tracer.passes.nesting import sweep_module

    sweep = sweep_module()
    if sweep is not None and hasattr(sweep, "str_rows") and type(spans) is list:
        try:
            rows: list[int] = sweep.str_rows(spans, "attrs", "gpu.kernel.name")
        except TypeError:
            pass  # attributes that are no dict: read as below
        else:
            return rows
    return [i for i, s in enumerate(spans) if isinstance(s.attrs.get("gpu.kernel.name"), str)]


def attribute_gpu_library(run: Run) -> Run:
    """Sets ``ml.library.name`` on every kernel span that lacks it.

    Kernel spans are those with a ``gpu.kernel.name`` attribute. Runs after
    ``attach_gpu_to_launch`` and ``nest_by_containment`` so that the
    launching op can settle generic GEMM kernels (see ``gpu_library_of``).
    Records the count per library under
    ``meta["correlation"]["attribute_gpu_library"]``.

    Args:
        run: the run (not modified).

    Returns:
        A run with a new span list; changed spans are copies with new attrs.
    """
    spans = run.spans
    rows = [i for i in _kernel_rows(spans) if "ml.library.name" not in spans[i].attrs]
    counts: dict[str, int] = {}
    known: dict[tuple[str, str | None], str] = {}  # a run repeats few (kernel, op) pairs many times
    out = list(spans)
    by_id = {s.id: s for s in spans} if rows else {}  # a run with no GPU kernel needs none
    for i in rows:
        s = spans[i]
        key = (s.attrs["gpu.kernel.name"], _op_of(s, by_id))
        lib = known.get(key)
        if lib is None:
            lib = known[key] = gpu_library_of(*key)
        counts[lib] = counts.get(lib, 0) + 1
        out[i] = Span(s.id, s.parent_id, s.level, s.name, s.start_ns, s.end_ns, s.track_id, {**s.attrs, "ml.library.name": lib})
    meta = dict(run.meta)
    correlation = dict(meta.get("correlation") or {})
    correlation["attribute_gpu_library"] = dict(sorted(counts.items()))
    meta["correlation"] = correlation
    return run.replace(spans=out, meta=meta)
