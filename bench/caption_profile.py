"""Where a caption batch's time goes: the profiled backend of ``caption_throughput.py --bare``.

:class:`ProfiledCaptioner` is lakeshard's transformers backend with clocks around its
parts, so the bench times ``caption_images`` itself (the stage's own code path):

* CPU work: image decode + resize (``udfs.captioner.load_image``, in the decode thread)
  and the processor (resize to patches, normalise, chat template) -- in the decode
  thread when the version prepares ahead, else in the generating thread;
* the vision tower (forward hooks on it);
* the prefill (from ``generate``'s start to its first token, less the vision tower);
* the decode steps: a logits processor that changes nothing stamps every new token,
  outside any compiled region; a decode step is the time between two stamps (the
  first one apart: it holds a compile's warm-up), ms per step the mean of the others;
* idle: the generating thread's time between one ``generate`` returning and the next
  starting (output decoding, caption checks, waiting on the decode thread): the
  accelerator has nothing queued then, since ``generate`` ends by copying its output
  to the host.

On CUDA the stamps are CUDA events on the stream (read after ``generate`` returns, so
they add no synchronisation: transformers 5 defers its per-step stopping check to keep
host and GPU overlapped); on a CPU the clock is wall time. Only torch, transformers and
the standard library: it runs where the bare bench runs.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass, field

from udfs import captioner as captioner_module
from udfs.caption_transformers import TransformersCaptioner

__all__ = ["BatchProfile", "ProfiledCaptioner", "profiled_load_image", "format_profile"]


@dataclass
class BatchProfile:
    """One ``generate`` call, in milliseconds."""

    images: int
    prompt_tokens: int
    processor_ms: float
    prepared_ahead: bool
    vision_ms: float = 0.0
    prefill_ms: float = 0.0
    steps: int = 0
    # `steps` tokens: the prefill makes the first, a decode step each of the others.
    first_step_ms: float = 0.0  # the first decode step: holds a compile's warm-up
    step_ms: float = 0.0  # mean of the later decode steps
    generate_ms: float = 0.0
    idle_before_ms: float = 0.0
    tokens: list[list[int]] = field(default_factory=list)  # generated ids, per row


class _Clock:
    """Marks on the GPU's stream (CUDA events: no synchronisation between them, so
    ``generate``'s own overlap of host and device is left alone) or wall time on a CPU;
    :meth:`settle` waits for the marks before they are read."""

    def __init__(self, device: str):
        import torch

        self._cuda = device.startswith("cuda")
        self._torch = torch

    def mark(self):
        if self._cuda:
            event = self._torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def settle(self) -> None:
        if self._cuda:
            self._torch.cuda.synchronize()

    def seconds(self, start, end) -> float:
        return start.elapsed_time(end) / 1000 if self._cuda else end - start


# Image decode time of the current pass (load_image runs in the decode thread).
_DECODE = {"seconds": 0.0, "images": 0}
_DECODE_LOCK = threading.Lock()


def profiled_load_image(data, min_pixels, max_pixels, _load=captioner_module.load_image):
    """``load_image`` with its time added to the pass's decode total."""
    t0 = time.perf_counter()
    try:
        return _load(data, min_pixels, max_pixels)
    finally:
        with _DECODE_LOCK:
            _DECODE["seconds"] += time.perf_counter() - t0
            _DECODE["images"] += 1


def take_decode_seconds() -> tuple[float, int]:
    """Decode seconds and images since the last call."""
    with _DECODE_LOCK:
        out = (_DECODE["seconds"], _DECODE["images"])
        _DECODE.update(seconds=0.0, images=0)
    return out


class ProfiledCaptioner(TransformersCaptioner):
    """The transformers backend, its batches timed (:attr:`batches`, one per generate)."""

    def __init__(self, spec, device: str):
        super().__init__(spec, device)
        self.clock = _Clock(device)
        self.batches: list[BatchProfile] = []
        self._processor_ms: dict[int, tuple[float, bool]] = {}  # id(batch) -> (ms, ahead)
        self._last_end: float | None = None
        self._vision: list[float] = []
        model = self.model
        vision = getattr(getattr(model, "model", model), "visual", None) or getattr(
            model, "visual", None)
        if vision is not None:
            vision.register_forward_pre_hook(lambda *_: self._vision.append(self.clock.mark()))
            vision.register_forward_hook(lambda *_: self._vision.append(self.clock.mark()))

    def reset(self) -> None:
        """Start a new pass: no batches, no idle time before the first one."""
        self.batches, self._last_end = [], None
        take_decode_seconds()

    def prepare(self, images, spec):
        t0 = time.perf_counter()
        batch = super().prepare(images, spec)
        ahead = threading.current_thread() is not threading.main_thread()
        self._processor_ms[id(batch)] = (1000 * (time.perf_counter() - t0), ahead)
        return batch

    def _prepared(self, images, spec):
        batch = super()._prepared(images, spec)
        ms, ahead = self._processor_ms.pop(id(batch), (0.0, False))
        self._pending = (len(images), ms, ahead)
        return batch

    def _run(self, inputs, gen: dict):
        from transformers import LogitsProcessorList

        clock = self.clock
        stamps: list = []

        def stamp(input_ids, scores):
            stamps.append(clock.mark())
            return scores

        n, processor_ms, ahead = self._pending
        prof = BatchProfile(n, int(inputs["input_ids"].shape[1]), processor_ms, ahead)
        self._vision = []
        start = clock.mark()
        out = super()._run(inputs, {**gen, "logits_processor": LogitsProcessorList([stamp])})
        end = clock.mark()
        clock.settle()
        ms = lambda a, b: 1000 * clock.seconds(a, b)  # noqa: E731
        if self._last_end is not None:
            prof.idle_before_ms = ms(self._last_end, start)
        self._last_end = end
        prof.vision_ms = sum(ms(a, b) for a, b in zip(self._vision[::2], self._vision[1::2],
                                                        strict=False))
        prof.generate_ms = ms(start, end)
        if stamps:
            prof.prefill_ms = ms(start, stamps[0]) - prof.vision_ms
            prof.steps = len(stamps)
            steps = [ms(a, b) for a, b in zip(stamps, stamps[1:], strict=False)]
            prof.first_step_ms = steps[0] if steps else ms(stamps[0], end)
            prof.step_ms = statistics.fmean(steps[1:]) if len(steps) > 1 else 0.0
        prof.tokens = out[:, inputs["input_ids"].shape[1]:].tolist()
        self.batches.append(prof)
        return out


_COLUMNS = (f"{'batch':>5} {'imgs':>5} {'prompt':>6} {'proc ms':>9} {'vision ms':>10} "
            f"{'prefill ms':>11} {'steps':>5} {'1st step':>9} {'ms/step':>8} "
            f"{'generate ms':>12} {'idle ms':>8}")


def format_profile(batches: list[BatchProfile], decode: tuple[float, int], seconds: float
                   ) -> list[str]:
    """One line per batch and a line of totals: where the pass's time went."""
    lines = [_COLUMNS]
    for k, b in enumerate(batches):
        proc = f"{b.processor_ms:8.0f}{'*' if b.prepared_ahead else ' '}"
        lines.append(
            f"{k:>5} {b.images:>5} {b.prompt_tokens:>6} {proc:>9} {b.vision_ms:>10.0f} "
            f"{b.prefill_ms:>11.0f} {b.steps:>5} {b.first_step_ms:>9.1f} {b.step_ms:>8.2f} "
            f"{b.generate_ms:>12.0f} {b.idle_before_ms:>8.0f}")
    total = {k: sum(getattr(b, k) for b in batches) / 1000 for k in (
        "processor_ms", "vision_ms", "prefill_ms", "generate_ms", "idle_before_ms")}
    steps = sum(max(b.steps - 2, 0) for b in batches)  # decode steps after the first
    step_s = sum(b.step_ms * max(b.steps - 2, 0) for b in batches) / 1000
    first_s = sum(b.first_step_ms for b in batches) / 1000
    lines.append(
        f"  pass {seconds:.2f} s: generate {total['generate_ms']:.2f} s = vision "
        f"{total['vision_ms']:.2f} + prefill {total['prefill_ms']:.2f} + first steps "
        f"{first_s:.2f} + {steps} later steps {step_s:.2f} "
        f"({1000 * step_s / steps if steps else 0:.2f} ms/step); idle between batches "
        f"{total['idle_before_ms']:.2f} s; CPU: processor {total['processor_ms']:.2f} s "
        f"(* = in the decode thread, ahead), image decode {decode[0]:.2f} s for "
        f"{decode[1]} images (decode thread)")
    return lines
