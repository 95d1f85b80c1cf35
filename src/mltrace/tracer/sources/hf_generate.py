"""Hugging Face ``generate()`` as a span that parents its model calls.

A decode loop calls the model once per new token; without this, 40 forward calls
of one ``generate()`` read as 40 unrelated model calls. ``GenerateSpans`` wraps
``transformers.generation.utils.GenerationMixin.generate`` once transformers is
imported (it never imports it), and removes the wrapper at ``stop()``:

- each outermost ``generate()`` call is a ``user``-level span named ``generate``
  (``ml.generate.model``: the model's class; ``code.*``: the user's line that
  called it, a model call's call site (``callsite.model_call_site``): the innermost
  frame of the program's own code, else the innermost outside the frameworks and
  outside transformers, so a pipeline's ``generate()`` names the line that called
  the pipeline), and the model calls inside it are its children;
- those model calls are tagged in order (``TorchModuleSource._model_begin`` calls
  ``tag``): ``ml.generate.step`` (0, 1, …) and ``ml.generate.phase``: ``encode`` for a
  call of another module before the generating model's first (an encoder-decoder's
  encoder, which ``generate()`` calls on its own and which makes no token),
  ``prefill`` for the generating model's first call and ``decode`` for the rest;
  their call site is the ``generate()`` span's (the user's line, not the decode
  loop's inside transformers);
- at its end the span gets ``ml.generate.model_calls`` and, where the output and
  the input ids say it, ``ml.generate.new_tokens`` per sequence.

``analysis/generation.py`` turns them into time to first token, time per output
token and tokens per second.
"""

from __future__ import annotations

import functools
import sys
import threading
from typing import TYPE_CHECKING, Any

from mltrace.run.levels import Level
from mltrace.tracer.callsite import model_call_site
from mltrace.tracer.sources._imports import PostImportHook

if TYPE_CHECKING:
    from mltrace.tracer.sources.base import SessionView

MODULE = "transformers.generation.utils"
#: The generating library: its frames (a pipeline, a model's own ``generate``) are not the call site.
LIBRARY = "transformers"


class _Generating(threading.local):
    """A thread's ``generate()`` call in progress: [the next model call's step, its call site's
    ``code.*``, the generating model, whether that model has been called yet], or None. A class
    attribute, so that reading it on a thread that never generated raises nothing (an
    AttributeError caught costs a model call ≈ 0.7 µs)."""

    state: list[Any] | None = None


class GenerateSpans:
    """The ``generate()`` wrapper's install, removal, and the tags of the model calls inside."""

    def __init__(self) -> None:
        self._tls = _Generating()
        self._session: SessionView | None = None
        self._hook: PostImportHook | None = None
        self._patched: tuple[Any, Any, Any] | None = None

    def start(self, session: SessionView) -> None:
        """Wraps ``generate`` now if transformers' generation module is imported, else at its import."""
        self._session = session
        self._hook = PostImportHook(MODULE, self._install)

    def stop(self) -> None:
        """Puts transformers' own ``generate`` back (unless someone wrapped it since)."""
        try:
            if self._patched is not None:
                mixin, original, ours = self._patched
                if mixin.__dict__.get("generate") is ours:
                    mixin.generate = original
        finally:
            self._patched = None
            self._session = None
            if self._hook is not None:
                self._hook.remove()
                self._hook = None

    def tag(self, attrs: dict[str, Any], module: Any) -> dict[str, Any] | None:
        """Adds the step and phase of ``module``'s model call made inside this thread's
        ``generate()``; returns that ``generate()``'s call site (its ``code.*``; empty where it
        has none), or None outside one."""
        state = self._tls.state
        if state is None:
            return None
        step = state[0]
        state[0] = step + 1
        attrs["ml.generate.step"] = step
        attrs["ml.generate.phase"] = _phase(state, module)
        return state[1]

    def _install(self, module: Any) -> None:
        mixin = getattr(module, "GenerationMixin", None)
        original = getattr(mixin, "__dict__", {}).get("generate")
        if original is None or self._session is None:
            return
        ours = self._wrap(original)
        mixin.generate = ours  # type: ignore[union-attr]
        self._patched = (mixin, original, ours)

    def _wrap(self, original: Any) -> Any:
        spans = self

        @functools.wraps(original)
        def generate(model: Any, *args: Any, **kwargs: Any) -> Any:
            session = spans._session
            if session is None or session.full or spans._tls.state is not None:
                return original(model, *args, **kwargs)  # no session, or a generate() inside one
            site = model_call_site(sys._getframe(1), outside=LIBRARY)
            span = session.recorder.begin("generate", Level.USER, {"ml.generate.model": type(model).__name__, **site})
            state = [0, site, model, False]
            spans._tls.state = state
            output = None
            try:
                output = original(model, *args, **kwargs)
                return output
            finally:
                spans._tls.state = None
                span.attrs["ml.generate.model_calls"] = state[0]
                tokens = new_tokens(model, args, kwargs, output)
                if tokens is not None:
                    span.attrs["ml.generate.new_tokens"] = tokens
                session.recorder.end(span)

        return generate


def _phase(state: list[Any], module: Any) -> str:
    """A model call's phase in its ``generate()`` (``state``: ``_Generating.state``): ``encode``
    before the generating model's first call, by another module; ``prefill`` for that first call;
    ``decode`` after it (marks the model as called)."""
    if state[3]:
        return "decode"
    if module is not state[2]:
        return "encode"
    state[3] = True
    return "prefill"


def new_tokens(model: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> int | None:
    """Tokens generated per sequence: the output's length less the prompt's (decoder-only
    models return the prompt too; encoder-decoder models start from one decoder token);
    None where either length cannot be read."""
    sequences = getattr(output, "sequences", output)
    out_len = _last_dim(sequences)
    if out_len is None:
        return None
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        return max(out_len - 1, 0)
    prompt = kwargs.get("input_ids", args[0] if args else None)
    in_len = _last_dim(prompt)
    return max(out_len - in_len, 0) if in_len is not None else None


def _last_dim(tensor: Any) -> int | None:
    shape = getattr(tensor, "shape", None)
    try:
        return int(shape[-1]) if shape is not None and len(shape) > 0 else None
    except (TypeError, ValueError, IndexError):
        return None
