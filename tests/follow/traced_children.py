"""Children started while a span is current in the parent, for the OTLP export of a followed run:
under an ``mltrace.span`` ("request") a spawn child and a fork child each run one inference and a
DataLoader's 2 workers run one each; a spawn child with nothing current; a spawn child under the
program's own OpenTelemetry span (its ids printed as ``otel <trace hex> <span hex>``). Each
child's model class is named after its case. Exits 0."""

import multiprocessing as mp
import sys

import torch
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from torch.utils.data import DataLoader, Dataset

import mltrace


def infer(case):
    model = type(case, (torch.nn.Sequential,), {})(torch.nn.Linear(4, 4), torch.nn.ReLU()).eval()
    with torch.no_grad():
        return model(torch.ones(1, 4)).sum()


class Inferences(Dataset):
    def __len__(self):
        return 2

    def __getitem__(self, i):
        return infer("Worker")


def run(method, case):
    child = mp.get_context(method).Process(target=infer, args=(case,))
    child.start()
    child.join()
    assert child.exitcode == 0, (case, child.exitcode)


def main():
    trace.set_tracer_provider(TracerProvider())
    with mltrace.span("request"):
        run("spawn", "SpawnUnder")
        run("fork", "ForkUnder")
        print("batches", len(list(DataLoader(Inferences(), batch_size=1, num_workers=2))), flush=True)
    run("spawn", "SpawnAlone")
    with trace.get_tracer("app").start_as_current_span("otel-request") as otel:
        ctx = otel.get_span_context()
        print(f"otel {ctx.trace_id:032x} {ctx.span_id:016x}", flush=True)
        run("spawn", "SpawnOtel")
    return 0


if __name__ == "__main__":
    sys.exit(main())
