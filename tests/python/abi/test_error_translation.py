"""hipferry's C++ errors as Python sees them through the pybind11 bindings
(translate_errors, csrc/torch/python_errors.h): the exception type torch
raises for the same error, and the message exactly as built, with no C++
backtrace ("Exception raised from ...") attached. The op paths
(torch.ops.hipferry.*) give the same message for an error they share."""
import pytest
import torch

import hipferry
from hipferry import _C
from conftest import installed_test_hooks, requires_test_hooks

BACKTRACE = "Exception raised from"
ADAMW = (1, 1e-3, 0.9, 0.999, 1e-8, 0.0, False, False)  # step, lr, betas, eps, weight_decay, amsgrad, maximize


def raised(call):
    with pytest.raises(Exception) as info:
        call()
    assert BACKTRACE not in str(info.value), str(info.value)
    return info.value


@requires_test_hooks
@pytest.mark.parametrize("kind,exc", [("value", ValueError), ("type", TypeError),
                                      ("oom", torch.OutOfMemoryError), ("runtime", RuntimeError)])
def test_each_hipferry_error_type_arrives_as_torchs_python_type(kind, exc):
    err = raised(lambda: installed_test_hooks().raise_error(kind, f"bad {kind}: 42"))
    assert type(err) is exc, type(err)
    assert str(err) == f"bad {kind}: 42"


@requires_test_hooks
def test_check_message_streams_every_argument():
    err = raised(lambda: installed_test_hooks().raise_error("nope", ""))
    assert type(err) is ValueError
    assert str(err) == "hipferry._C._testing.raise_error: kind must be value, type, oom or runtime, got 'nope'"


def test_value_errors_stream_c10_types_as_torch_check_did():
    # Layout, Device and ScalarType go through c10's operator<<, as in TORCH_CHECK's message.
    with hipferry.PinnedPool(capacity="1MiB") as pool:
        err = raised(lambda: _C.start_prefetch([torch.ones(3), torch.eye(3).to_sparse()], torch.device("cpu"), None,
                                               pool._id))
        assert type(err) is ValueError
        assert str(err) == "hipferry.prefetch: tensors[1] has layout Sparse; expected strided (dense) tensors"
        err = raised(lambda: _C.start_offload([torch.ones(2), torch.ones(2, device="meta")], None, pool._id))
        assert type(err) is ValueError
        assert str(err) == "hipferry.offload: tensors[1] is on meta; expected tensors on a GPU (or the CPU)"
    streamer = _C.AdamWStreamer(-1, 16, 2)
    half = torch.zeros(4, dtype=torch.half)
    err = raised(lambda: streamer.step([torch.ones(4)], [torch.ones(4)], [None], [half], [torch.zeros(4)], [None],
                                       *ADAMW))
    assert type(err) is ValueError
    assert str(err) == ("AdamWStreamer.step: exp_avgs[0] must be a contiguous float32 host tensor with 4 elements; "
                        "got torch.float16 on cpu with 4 elements")
    err = raised(lambda: _C.InFlightWindow(0))
    assert type(err) is ValueError and str(err) == "InFlightWindow: max_bytes must be > 0, got 0"


def test_c10_errors_of_shared_op_code_keep_their_type_through_pybind():
    # LayerCopier runs copy_cast_'s checks, which stay c10 errors (RuntimeError, no backtrace).
    err = raised(lambda: _C.LayerCopier(-1).start([torch.ones(2)], [torch.ones(3)]))
    assert type(err) is RuntimeError
    assert str(err) == "hipferry.copy_cast_: dst has shape [2] but src has shape [3]; expected equal shapes"


def test_pool_capacity_through_a_transfer_is_torch_out_of_memory_as_from_the_op():
    with hipferry.PinnedPool(capacity="1MiB") as pool:
        too_big = torch.ones(1 << 19)  # 2 MiB
        via_pybind = raised(lambda: hipferry.prefetch(too_big, "cpu", pool=pool))
        via_op = raised(lambda: pool.empty(1 << 19))
        assert type(via_pybind) is torch.OutOfMemoryError and type(via_op) is torch.OutOfMemoryError
        assert "capacity" in str(via_pybind)
        assert str(via_pybind) == str(via_op)


def test_closed_pool_id_is_the_same_runtime_error_from_pybind_and_from_the_op():
    pool = hipferry.PinnedPool(capacity="1MiB")
    pool_id = pool._id
    pool.close()
    message = f"hipferry: pinned pool {pool_id} does not exist (it was closed); expected an open PinnedPool"
    for call in (lambda: _C.pool_stats(pool_id), lambda: _C.pool_trim(pool_id),
                 lambda: torch.ops.hipferry.pool_empty.default(pool_id, [4], torch.float32, -1)):
        err = raised(call)
        assert type(err) is RuntimeError and str(err) == message
