"""The rare nesting: an ``mltrace.span`` around the program's own OpenTelemetry span around a torch
model, 3 times. Prints each OpenTelemetry span's ids (``otel <trace hex> <span hex>``), then
``ran`` and waits for a line on stdin (so the live export sends while it runs), then exits 0."""

import sys

import torch
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

import mltrace

trace.set_tracer_provider(TracerProvider())
tracer = trace.get_tracer("app")
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).eval()
with torch.no_grad():
    for i in range(3):
        with mltrace.span("outer", i=i), tracer.start_as_current_span("otel-request") as otel:
            ctx = otel.get_span_context()
            print(f"otel {ctx.trace_id:032x} {ctx.span_id:016x}", flush=True)
            model(torch.ones(2, 8))
print("ran", flush=True)
sys.stdin.readline()
