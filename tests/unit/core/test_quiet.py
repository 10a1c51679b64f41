"""The warnings torch's stack logs at import on a machine without CUDA are dropped by message
only (the commands' own output: tests/cli/test_import_noise.py)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from app.core.quiet import IMPORT_NOISE, ImportNoise, quiet_import_warnings

TORCHAO_NOISE = (
    "Failed to load /venv/lib/python3.11/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: "
    "Could not load this library: /venv/lib/python3.11/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so"
)
PYTREE_NOISE = (
    "%s is an Enum subclass and is now natively supported by torch.compile as an opaque value type. "
    "Calling register_constant() on Enum subclasses is deprecated and will be an error in a future release."
)


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def records() -> Iterator[Records]:
    handler = Records()
    loggers = [logging.getLogger(name) for name in IMPORT_NOISE]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield handler
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
            for noise in [f for f in logger.filters if isinstance(f, ImportNoise)]:
                logger.removeFilter(noise)


def test_only_the_known_import_messages_are_dropped(records: Records) -> None:
    quiet_import_warnings()
    quiet_import_warnings()  # idempotent: one filter per logger
    assert all(sum(isinstance(f, ImportNoise) for f in logging.getLogger(n).filters) == 1 for n in IMPORT_NOISE)
    torchao, pytree = logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")
    torchao.warning(TORCHAO_NOISE)
    logging.getLogger("torchao.kernel.intmm").warning(  # a child logger: its own filter (parents' do not apply)
        "Warning: Detected no triton, on systems without Triton certain kernels will not work"
    )
    pytree.warning(PYTREE_NOISE, "<enum 'KernelPreference'>")
    torchao.warning("Failed to load checkpoint weights.bin: truncated")  # not a kernel library
    torchao.error("int8 weight-only quantization is not supported on this device")
    pytree.warning("some other pytree warning")
    assert records.messages == [
        "Failed to load checkpoint weights.bin: truncated",
        "int8 weight-only quantization is not supported on this device",
        "some other pytree warning",
    ]
