"""After a job runs out of memory its pool process takes the next job (R21: a smaller job still
runs on the machine), so the failed run must not keep what it allocated: the error Celery keeps
holds a traceback whose frames hold the forward pass's tensors (tasks/run_job.py)."""

from __future__ import annotations

import weakref

import torch

from tasks.run_job import failure_reason, release_failed_run


def _failed_forward(refs: list[weakref.ref[torch.Tensor]]) -> None:
    activation = torch.zeros(256, 256)  # a local of the failed pass, as a UNet block's output is
    refs.append(weakref.ref(activation))
    raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory")


def test_r21_an_oom_s_frames_no_longer_hold_its_tensors_once_released() -> None:
    refs: list[weakref.ref[torch.Tensor]] = []
    kept: BaseException | None = None
    try:
        _failed_forward(refs)
    except RuntimeError as error:
        kept = error  # what Celery keeps with the task's outcome
    assert kept is not None and failure_reason(kept) == "oom"
    assert refs[0]() is not None  # the premise: the traceback's frame keeps the tensor alive
    release_failed_run(kept)
    assert refs[0]() is None
    assert str(kept).endswith("can't allocate memory")  # the error itself is still reported whole


def test_r21_onednn_s_failed_allocation_is_an_oom_and_its_unsupported_configuration_is_not() -> None:
    assert failure_reason(RuntimeError("could not create a primitive")) == "oom"  # under prlimit --as
    unsupported = "could not create a primitive descriptor for a convolution forward propagation primitive"
    assert failure_reason(RuntimeError(unsupported)) == "error"
    assert failure_reason(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) == "error"
