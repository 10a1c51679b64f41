"""Keeping the logs readable: the import-time messages torch's stack logs on a machine without
CUDA are dropped, and only those (matched by logger and message). Imports nothing heavy, so
every command can call :func:`quiet_import_warnings` before it imports torch.
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
from collections.abc import Iterator


class ImportNoise(logging.Filter):
    """Drops the log records of one logger whose message matches ``pattern``, and only those."""

    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


#: logger -> the one message it logs while torch's stack is imported on a machine without CUDA
#: (transformers' quantizers import torchao eagerly, so every command that imports diffusers
#: or transformers gets them): torchao cannot load its CUDA kernel libraries (``_C*.so``) and
#: finds no Triton (a GPU compiler) at the first pipeline load, and it registers enums with
#: torch's pytree, which torch now says it no longer needs. A logger's filters do not see its
#: children's records, so each logger is named exactly.
IMPORT_NOISE: dict[str, str] = {
    "torchao": r"^Failed to load \S*torchao/_C[^/\s]*\.so: ",
    "torchao.kernel.intmm": r"^Warning: Detected no triton, on systems without Triton certain kernels will not work$",
    "torch.utils._pytree": r"is an Enum subclass and is now natively supported by torch\.compile "
    r"as an opaque value type",
    # transformers 5 resolves a pipeline's `CLIPImageProcessor` (a feature extractor class named in
    # model_index.json) to its PIL backend when torchvision is absent, as this CPU install has it
    "transformers.utils.import_utils": r"^`\w+ImageProcessor` requires torchvision \(not installed\); "
    r"falling back to `\w+ImageProcessorPil`",
    # diffusers' torchao quantizer lists torchao's tensor classes for torch.load; torchao 0.18 moved
    # some, and only checkpoints torchao serialized (which Homefleet does not load) need them
    "diffusers.quantizers.torchao.torchao_quantizer": r"^Unable to import `torchao` Tensor objects\. ",
}


def quiet_import_warnings() -> None:
    """Drop the import-time log messages of :data:`IMPORT_NOISE` (matched by message, so any
    other warning of torchao or torch still shows). Imports nothing; safe to call twice."""
    for name, pattern in IMPORT_NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, ImportNoise) and f.pattern.pattern == pattern for f in logger.filters):
            logger.addFilter(ImportNoise(pattern))


@contextlib.contextmanager
def quiet_libraries() -> Iterator[None]:
    """For the body: diffusers' and transformers' logs at ERROR, their progress bars hidden and
    their deprecation/user warnings ignored (building, converting or saving a pipeline);
    restored afterwards. Imports both libraries when entered."""
    import diffusers.utils.logging as d_log
    import transformers.utils.logging as t_log

    d_level, t_level = d_log.get_verbosity(), t_log.get_verbosity()
    d_bars, t_bars = d_log.is_progress_bar_enabled(), t_log.is_progress_bar_enabled()
    d_log.set_verbosity(logging.ERROR)
    t_log.set_verbosity(logging.ERROR)
    d_log.disable_progress_bar()
    t_log.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            for category in (FutureWarning, DeprecationWarning, UserWarning):
                warnings.filterwarnings(
                    "ignore", category=category, module=r"(diffusers|transformers|huggingface_hub)(\.|$)"
                )
            yield
    finally:
        d_log.set_verbosity(d_level)
        t_log.set_verbosity(t_level)
        if d_bars:
            d_log.enable_progress_bar()
        if t_bars:
            t_log.enable_progress_bar()
