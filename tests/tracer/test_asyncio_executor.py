"""Model calls that ``loop.run_in_executor`` runs in a worker thread nest in the request span open
in the awaiting task (``tracer/sources/asyncio_executor.py``), while the program's own context
variables, results, exceptions and refusals stay as they are without mltrace."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

import mltrace
from mltrace.native import c_helper
from mltrace.run.levels import Level
from mltrace.settings import EXECUTOR_CARRY
from mltrace.tracer.sources.asyncio_executor import CarriedCall

PACKAGE_DIR = str(Path(mltrace.__file__).resolve().parent)
C_CARRY = c_helper("_carry", EXECUTOR_CARRY)

torch = pytest.importorskip("torch")

program_var: contextvars.ContextVar[str] = contextvars.ContextVar("program_var", default="unset")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)).eval()


def test_a_model_call_in_run_in_executor_is_inside_the_tasks_request(tmp_path: Path) -> None:
    """One request per way of calling (an explicit executor, the default one, a
    ``functools.partial``), and a call submitted to the same worker thread afterwards, outside
    any request, has no parent: the span is reset after each call."""
    model, pool = _model(), ThreadPoolExecutor(1)

    def infer(x: torch.Tensor, scale: float = 1.0) -> int:
        with torch.no_grad():
            return int(model(x * scale).argmax())

    async def handle(rid: int) -> int:
        with mltrace.span("request", rid=rid):
            loop, x = asyncio.get_running_loop(), torch.ones(1, 8) * rid
            if rid == 0:
                return await loop.run_in_executor(pool, infer, x)
            if rid == 1:
                return await loop.run_in_executor(None, infer, x)
            return await loop.run_in_executor(pool, functools.partial(infer, scale=0.5), x)

    async def main() -> list[int]:
        return list(await asyncio.gather(*(handle(i) for i in range(3))))

    with mltrace.profile(output=tmp_path / "r", summary=False, level="model"):
        got = asyncio.run(main())
        pool.submit(infer, torch.ones(1, 8)).result()
    pool.shutdown()
    run = mltrace.load_run(tmp_path / "r")
    requests = {s.id: s.attrs["rid"] for s in run.spans if s.name == "request"}
    models = [s for s in run.spans if s.level == Level.MODEL]
    assert len(got) == 3 and len(requests) == 3 and len(models) == 4
    assert sorted(requests[s.parent_id] for s in models if s.parent_id in requests) == [0, 1, 2]
    assert [s.parent_id for s in models if s.parent_id not in requests] == [None]


def test_the_program_sees_its_own_context_results_and_errors(tmp_path: Path) -> None:
    """The program's context variables are not carried into the worker (as without mltrace), a
    result is the function's own object, an exception its own, and a debug-mode loop refuses a
    coroutine function and what is no callable as before; the session's end puts the original method back."""
    original = asyncio.BaseEventLoop.run_in_executor
    result = object()

    def failing() -> None:
        raise ValueError("bad input")

    async def coro() -> None:
        return None

    async def main() -> tuple[str, object, BaseException, tuple[BaseException, BaseException]]:
        loop = asyncio.get_running_loop()
        program_var.set("set in the task")
        with mltrace.span("request"):
            seen = await loop.run_in_executor(None, program_var.get)
            same = await loop.run_in_executor(None, lambda: result)
            with pytest.raises(ValueError) as failed:
                await loop.run_in_executor(None, failing)
            with pytest.raises(TypeError) as refused:
                await loop.run_in_executor(None, coro)  # type: ignore[arg-type]
            with pytest.raises(TypeError) as uncallable:
                await loop.run_in_executor(None, 5)  # type: ignore[arg-type]
        return seen, same, failed.value, (refused.value, uncallable.value)

    with mltrace.profile(output=tmp_path / "r", summary=False, level="model"):
        assert asyncio.BaseEventLoop.run_in_executor is not original
        seen, same, failed, (refused, uncallable) = asyncio.run(main(), debug=True)  # debug: the refusals
    assert asyncio.BaseEventLoop.run_in_executor is original
    assert seen == "unset" and same is result
    assert type(failed) is ValueError and failed.args == ("bad input",)
    if C_CARRY is not None:  # the C call adds no frame: the traceback is the program's as without mltrace
        assert [f.name for f in traceback.extract_tb(failed.__traceback__) if f.filename.startswith(PACKAGE_DIR)] == []
    assert "coroutines cannot be used with run_in_executor()" in str(refused)
    assert "a callable object was expected by run_in_executor(), got 5" in str(uncallable)


def test_the_tasks_opentelemetry_span_is_the_parent_of_a_model_call_in_the_worker(tmp_path: Path) -> None:
    """The program's OpenTelemetry request span, current in the task and not in the worker,
    is the model call's OpenTelemetry parent (the OTLP export puts the call in its trace)."""
    sdk = pytest.importorskip("opentelemetry.sdk.trace")
    model = _model()

    def infer(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model(x)

    async def main() -> str:
        tracer = sdk.TracerProvider().get_tracer("test")
        with tracer.start_as_current_span("POST /predict") as span:
            await asyncio.get_running_loop().run_in_executor(None, infer, torch.ones(1, 8))
        ctx = span.get_span_context()
        return f"{ctx.trace_id:032x}-{ctx.span_id:016x}"

    with mltrace.profile(output=tmp_path / "r", summary=False, level="model"):
        ids = asyncio.run(main())
    run = mltrace.load_run(tmp_path / "r")
    assert [s.attrs.get("mltrace.otel.parent") for s in run.spans if s.level == Level.MODEL] == [ids]


@pytest.mark.parametrize("carried", [CarriedCall, getattr(C_CARRY, "CarriedCall", None)], ids=["python", "c"])
def test_a_carried_call_sets_its_variables_around_the_call_alone(carried: Any) -> None:
    """Set for the call, reset after it, an exception or a result going through as they are."""
    if carried is None:
        pytest.skip("the C helper was not built")
    var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="before")
    other: contextvars.ContextVar[int] = contextvars.ContextVar("other", default=0)
    seen = []

    def add(x: int, *, y: int) -> int:
        seen.append((var.get(), other.get()))
        return x + y

    def failing() -> None:
        seen.append((var.get(), other.get()))
        raise KeyError("k")

    assert carried(add, ((var, "during"), (other, 7)))(1, y=2) == 3
    with pytest.raises(KeyError) as raised:
        carried(failing, ((var, "again"), (other, 8)))()
    assert raised.value.args == ("k",)
    assert seen == [("during", 7), ("again", 8)] and (var.get(), other.get()) == ("before", 0)
