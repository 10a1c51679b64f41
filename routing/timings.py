"""Learned timings (R13): per (machine, model, kind) load seconds and seconds per step at a
reference size, starting from the fleet config's guesses and replaced by measurements.

Pure: no storage here. ``app/journal/timings.py`` persists a :class:`LearnedTimings` in the journal
database so a restart keeps it; the placement simulator (``bench/placement.py``) uses the same
class in memory.

Units: ``load_s`` seconds for a cold load; ``step_s`` seconds per diffusion step for a job of
the reference size (``REFERENCE_SIZE`` = 1024 x 1024 pixels x 1 frame x batch 1) on that
machine. A job's run seconds scale with its size (pixels x frames x batch), from
``MIN_SCALED_SIZE`` up (below it a step costs what a step of that size does), and one image's
seconds (pixels x frames) with its size to the power ``size_exp``: 1 (linear) until two runs
whose images differ in size by at least ``SIZE_EXP_MIN_RATIO`` teach it (attention grows with
the square of the latent's tokens, so a large image costs more than its pixels say). A batch
is linear: n images cost n images.

Text jobs (kind ``text``) are priced per token instead: ``step_s`` is seconds per new
token and ``prompt_s`` seconds per prompt token, so a job's run seconds are ``step_s`` x new
tokens + ``prompt_s`` x prompt tokens (its "steps" are new tokens, its "size" prompt tokens,
``app.core.kinds.job_request``), with no reference size.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

REFERENCE_SIZE = 1024 * 1024
"""Pixels x frames x batch of the reference job that ``step_s`` is measured for."""

MIN_SCALED_SIZE = 256 * 256
"""Sizes below this are priced by their own measured step (``Timing.small_step_s``), and until one
is measured as a step of this size. A step's fixed work (scheduler, conditioning, kernel
launches) dominates small images: a 64x64 and an 8x8 step of the same tiny model took 0.54 and
0.30 s on a CPU, so scaling purely by pixels learned an 8x8 job's step as 36 times a 64x64 one's,
and Auto shunned that machine (new-user pass). Above 256x256 real diffusion steps grow roughly
with pixels (seed-fleet.md's figures per resolution)."""

SIZE_EXP_MIN_RATIO = 2.0
"""Two runs teach the size exponent only when one's image size (pixels x frames, both at least
``MIN_SCALED_SIZE``) is at least this many times the other's: closer sizes leave a run's noise (+-10 % between identical
jobs) to decide it. 768 x 768 against 1024 x 1024 (1.8x) teaches nothing; 512 against 1024 (4x)
does."""

SIZE_EXP_BOUNDS = (0.5, 2.5)
"""The least and largest size exponent learned (a run slowed or sped by something else, e.g. a
machine busy with another process, cannot make it absurd). Attention is quadratic in the
latent's tokens, so 2 is the most a step grows where it dominates: the tiny sd1 pipeline
(``homefleet models make-tiny``) took 1.63 and 21.6 s a step at 256 x 256 and 512 x 512 on the
2-core CPU host, 1.86; real diffusion models at their usual sizes grow less."""

TEXT_KIND = "text"
"""The kind whose timings are per token (``step_s`` per new token, ``prompt_s`` per prompt token)."""

ADAPTER_KIND = "adapter"
"""The registry kind of a LoRA adapter: it runs no job of its own; its timing's
``load_s`` is the seconds to load it onto a warm pipeline of its base family (``step_s`` unused)."""

EMA_WEIGHT = 0.3
"""Weight of a new measurement in the exponential moving average (R13)."""

SHIFT_RATIO = 2.5
"""A run whose seconds are more than this many times its estimate, or less than its inverse, is a
large miss. Identical jobs vary by about 10 %, and an estimate once learned stays within a
few tens of percent of what the next run takes; a run 2.5x off is not noise but one of two
things: an outlier (the machine busy with something else once) or a change of regime (a GPU
fallen back to its CPU, a machine swapping, then repaired). The moving average takes about
12 runs to follow a 100x fall (0.7 ** 12 = 0.014), while a machine priced 100x too slow gets
no Auto jobs to learn from."""

SHIFT_RUNS = 2
"""Large misses in a row, in the same direction, that make the latest run the figure outright (a
change of regime, as a first measurement replaces a guess); one alone is folded in as usual
(an outlier moves the figure by ``EMA_WEIGHT`` only)."""

TimingKey = tuple[str, str, str]  # (machine, model_id, kind)


@dataclass(frozen=True)
class Timing:
    """Seconds for one (machine, model, kind): a cold load and one step at the reference size."""

    load_s: float
    step_s: float
    samples: int = 0  # runs folded into step_s; 0 = still the fleet config's guess
    load_samples: int = 0  # cold loads folded into load_s; 0 = load_s is still the guess
    prompt_s: float = 0.0  # text kind only: seconds per prompt token (step_s: per new token)
    size_exp: float = 1.0  # run seconds grow with size ** size_exp (not for text)
    size_samples: int = 0  # pairs of runs folded into size_exp; 0 = still linear, the prior
    anchor_size: int = 0  # the last run's image size (pixels x frames, at least MIN_SCALED_SIZE; 0: none yet)
    anchor_step_s: float = 0.0  # and its seconds per step at the reference size, priced linearly
    misses: int = 0  # large misses in a row (SHIFT_RATIO): + runs slower than estimated, - faster
    small_step_s: float = 0.0  # seconds a step of one image under MIN_SCALED_SIZE (0: none measured yet)


def job_size(pixels: int, frames: int = 1, batch: int = 1) -> int:
    """Pixels x frames x batch: the size that run time and working memory scale with."""
    return max(1, pixels) * max(1, frames) * max(1, batch)


def run_seconds(timing: Timing, steps: int, size: int, kind: str = "", batch: int = 1) -> float:
    """Expected run seconds (no load) of ``steps`` steps on a job of ``size`` (see :func:`job_size`;
    ``batch`` of its images); for ``kind`` text, of ``steps`` new tokens after ``size`` prompt tokens.

    Linear in ``size`` (floored at ``MIN_SCALED_SIZE``), times ``(image / REFERENCE_SIZE) **
    (size_exp - 1)`` for the size of one image of the batch (pixels x frames, floored alike): a
    batch of four costs four images, not one image four times as large. Images under
    ``MIN_SCALED_SIZE`` cost ``small_step_s`` a step each once such a run has been measured."""
    if kind == TEXT_KIND:
        return timing.step_s * max(0, steps) + timing.prompt_s * max(0, size)
    if timing.small_step_s > 0 and image_size(size, batch) < MIN_SCALED_SIZE:  # measured on small images
        return timing.small_step_s * max(1, steps) * max(1, batch)
    linear_s = timing.step_s * max(1, steps) * max(size, MIN_SCALED_SIZE) / REFERENCE_SIZE
    if timing.size_exp == 1.0:  # linear: the same float as before size exponents were learned
        return linear_s
    return linear_s * excess_scale(image_size(size, batch), timing.size_exp)


def image_size(size: int, batch: int) -> int:
    """One image's size (pixels x frames) of a job of ``size`` (pixels x frames x ``batch``)."""
    return max(1, size // max(1, batch))


def excess_scale(image: int, exponent: float) -> float:
    """What a step of one image of ``image`` pixels x frames costs beyond linear pricing:
    ``(max(image, MIN_SCALED_SIZE) / REFERENCE_SIZE) ** (exponent - 1)``."""
    return float((max(image, MIN_SCALED_SIZE) / REFERENCE_SIZE) ** (exponent - 1.0))


def fit_size_exp(base: Timing, image: int, linear_step_s: float) -> tuple[float, int]:
    """(size exponent, pairs folded in) after a run whose images are ``image`` pixels x frames
    (at least ``MIN_SCALED_SIZE``) and whose step, priced linearly, is ``linear_step_s`` seconds
    at the reference size, from ``base``'s anchor (its last such run): unchanged unless one
    image size is at least ``SIZE_EXP_MIN_RATIO`` times the other; then the pair's exponent
    ``1 + ln(ratio of the linear steps) / ln(ratio of the image sizes)``, within
    ``SIZE_EXP_BOUNDS``, replaces the linear prior (first pair) or is folded in with weight
    ``EMA_WEIGHT``. Batches of one image size (n = 1 and n = 4) teach nothing: a batch is linear."""
    anchor, anchor_step_s = base.anchor_size, base.anchor_step_s
    if anchor <= 0 or anchor_step_s <= 0 or linear_step_s <= 0:
        return base.size_exp, base.size_samples
    ratio = image / anchor
    if max(ratio, 1 / ratio) < SIZE_EXP_MIN_RATIO:
        return base.size_exp, base.size_samples
    low, high = SIZE_EXP_BOUNDS
    pair = min(max(1.0 + math.log(linear_step_s / anchor_step_s) / math.log(ratio), low), high)
    if base.size_samples == 0:
        return pair, 1
    return (1 - EMA_WEIGHT) * base.size_exp + EMA_WEIGHT * pair, base.size_samples + 1


TOKEN_FIT_KEEP = 0.5
"""The least share of a text timing's per-token figure one finished job leaves (see :func:`fit_tokens`)."""


def fit_tokens(base: Timing, first: bool, run_s: float, new_tokens: int, prompt_tokens: int) -> tuple[float, float]:
    """A text timing's (seconds per new token, seconds per prompt token) after one finished job
    of ``new_tokens`` generated after ``prompt_tokens`` that ran ``run_s`` seconds.

    ``first`` (``base`` is the guess): both figures scaled by the one factor that makes the job's
    estimate its measurement (one job cannot tell prefill from decoding; the guess's ratio is
    kept). Later: a normalised least-mean-squares step of weight ``EMA_WEIGHT`` along the job's
    (new, prompt) token counts, so jobs of different shapes separate the two figures. One job
    takes at most ``1 - TOKEN_FIT_KEEP`` of either figure away: a run faster than its estimate
    shrinks a figure geometrically but never to 0 (prefill and decoding always cost something;
    a figure clamped at 0 would price long prompts as free until a slower run came).
    """
    estimate = base.step_s * new_tokens + base.prompt_s * prompt_tokens
    if first:
        if estimate <= 0:  # a guess of 0 s: every second is the new tokens'
            return max(run_s, 0.0) / max(1, new_tokens + prompt_tokens), base.prompt_s
        factor = max(run_s, 0.0) / estimate
        return base.step_s * factor, base.prompt_s * factor
    norm = new_tokens * new_tokens + prompt_tokens * prompt_tokens
    if norm == 0:
        return base.step_s, base.prompt_s
    gain = EMA_WEIGHT * (max(run_s, 0.0) - estimate) / norm
    return (
        max(TOKEN_FIT_KEEP * base.step_s, base.step_s + gain * new_tokens),
        max(TOKEN_FIT_KEEP * base.prompt_s, base.prompt_s + gain * prompt_tokens),
    )


def large_miss(run_s: float, expected_s: float) -> int:
    """+1 when ``run_s`` is more than :data:`SHIFT_RATIO` times ``expected_s`` (seconds), -1 when
    it is less than its inverse, else 0 (a run or an estimate of 0 s counts as no miss)."""
    if run_s <= 0 or expected_s <= 0:
        return 0
    if run_s > SHIFT_RATIO * expected_s:
        return 1
    return -1 if run_s * SHIFT_RATIO < expected_s else 0


def misses_after(misses: int, miss: int) -> int:
    """Large misses in a row after a run whose miss is ``miss`` (:func:`large_miss`), ``misses``
    before it: one more in the same direction, else this run's alone (0 when it was no miss)."""
    if miss == 0:
        return 0
    return misses + miss if misses * miss > 0 else miss


class LearnedTimings:
    """Measured timings by (machine, model, kind), folded in with an EMA (weight ``EMA_WEIGHT``).

    The first measurement of each figure replaces the guess outright (a guess is not a
    measurement): ``step_s`` at the first finished run, ``load_s`` at the first cold load,
    which may come later (a model already warm when timings began). Run seconds that miss the
    estimate by more than :data:`SHIFT_RATIO` :data:`SHIFT_RUNS` times in a row, the same way,
    replace the run figures outright too (a change of regime; R13).

    Images under :data:`MIN_SCALED_SIZE` (thumbnails) are mostly a step's fixed costs: a 64x64
    step of the tiny sd1 pipeline on a CPU is about a twentieth of a 256x256 one. Their runs teach
    their own figure, ``small_step_s`` (seconds a step per image, whatever their size), which
    prices them; for larger images they are only a floor: until a run at or above that size is
    measured (``anchor_size``), the step figure (the guess) is raised to at least what a small
    step says, never lowered; that first run replaces it.
    """

    def __init__(self, entries: Mapping[TimingKey, Timing] | None = None) -> None:
        self._entries: dict[TimingKey, Timing] = dict(entries or {})
        self.version = 0  # bumped by every observation (lets estimators cache lookups)

    def get(self, machine: str, model_id: str, kind: str) -> Timing | None:
        return self._entries.get((machine, model_id, kind))

    def items(self) -> Iterator[tuple[TimingKey, Timing]]:
        return iter(list(self._entries.items()))

    def observe(
        self,
        machine: str,
        model_id: str,
        kind: str,
        *,
        guess: Timing,
        run_s: float,
        steps: int,
        size: int,
        load_s: float | None = None,
        batch: int = 1,
    ) -> Timing:
        """Fold one finished job in and return the new timing.

        Args:
            guess: the timing used until now when nothing was measured (fleet config).
            run_s: measured run seconds (no load), >= 0.
            steps, size: the job's steps and size (:func:`job_size`); for ``kind`` text, its
                new tokens and prompt tokens (:func:`fit_tokens`).
            batch: the images of the job (its size's batch): the size exponent is learned
                from one image's size (:func:`fit_size_exp`), only from images of at least
                ``MIN_SCALED_SIZE`` (smaller ones cost what that size does: their fixed costs
                would teach a steep, false exponent).
            load_s: measured seconds of a cold load, or None when the model was warm.
        """
        key = (machine, model_id, kind)
        old = self._entries.get(key)
        base = old or guess
        prompt_s, samples, misses, small_step_s = base.prompt_s, base.samples + 1, base.misses, base.small_step_s
        size_exp, size_samples = base.size_exp, base.size_samples
        anchor_size, anchor_step_s = base.anchor_size, base.anchor_step_s
        if kind == TEXT_KIND:
            misses = misses_after(misses, large_miss(run_s, run_seconds(base, steps, size, kind)))
            replaced = old is None or abs(misses) >= SHIFT_RUNS  # a guess, or a past regime (SHIFT_RUNS)
            step_s, prompt_s = fit_tokens(base, replaced, run_s, steps, size)
        else:
            linear_step_s = max(run_s, 0.0) / max(1, steps) * REFERENCE_SIZE / max(size, MIN_SCALED_SIZE)
            image = image_size(size, batch)
            scales = image >= MIN_SCALED_SIZE  # its step grows with the size; below, fixed costs dominate
            if scales:
                size_exp, size_samples = fit_size_exp(base, image, linear_step_s)
            measured_step_s = linear_step_s
            if size_exp != 1.0:
                measured_step_s = linear_step_s / excess_scale(image, size_exp)
            known_s = base.step_s
            if size_exp != base.size_exp:  # re-based: what it said at its last run's size, under the new exponent
                known_s *= excess_scale(anchor_size, base.size_exp) / excess_scale(anchor_size, size_exp)
            if scales:  # measured against what the figure says at this size, under the exponent now learned
                misses = misses_after(misses, large_miss(measured_step_s, known_s))
            # a guess, a past regime (SHIFT_RUNS) or a figure no run at a scaling size measured is replaced
            replaced = scales and (old is None or abs(misses) >= SHIFT_RUNS or base.anchor_size == 0)
            if replaced:
                step_s = measured_step_s
            elif not scales:  # a small image's step, mostly fixed costs: its own figure, and a floor for the rest
                step_s, samples = base.step_s, base.samples
                small = max(run_s, 0.0) / max(1, steps) / max(1, batch)
                small_step_s = small
                if base.small_step_s > 0:
                    small_step_s = (1 - EMA_WEIGHT) * base.small_step_s + EMA_WEIGHT * small
                if base.anchor_size == 0:  # a step at the least scaled size costs at least a small image's
                    step_s = max(step_s, small * REFERENCE_SIZE / MIN_SCALED_SIZE)
            else:
                step_s = (1 - EMA_WEIGHT) * known_s + EMA_WEIGHT * measured_step_s
            if scales:
                anchor_size, anchor_step_s = image, linear_step_s
        if replaced:
            misses = 0
        if load_s is None:
            new_load_s = base.load_s
        elif base.load_samples == 0:
            new_load_s = load_s
        else:
            new_load_s = (1 - EMA_WEIGHT) * base.load_s + EMA_WEIGHT * load_s
        timing = Timing(
            load_s=new_load_s,
            step_s=step_s,
            samples=samples,
            load_samples=base.load_samples + (load_s is not None),
            prompt_s=prompt_s,
            size_exp=size_exp,
            size_samples=size_samples,
            anchor_size=anchor_size,
            anchor_step_s=anchor_step_s,
            misses=misses,
            small_step_s=small_step_s,
        )
        self._entries[key] = timing
        self.version += 1
        return timing
