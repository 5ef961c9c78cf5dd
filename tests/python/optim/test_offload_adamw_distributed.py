"""OffloadAdamW under torch.distributed on the CPU (gloo, 2 processes): DDP and FSDP2
(fully_shard, DTensor parameters: each rank steps its local shard) train a small MLP for
10 steps with a warmup+cosine schedule and gradient clipping, each rank on half of the
global batch, and end where single-process full-batch training with OffloadAdamW ends.

Tolerance: normwise relative 1e-5 per parameter. The gradient allreduce / reduce-scatter
sums the two halves' gradients in another order than one full-batch backward does, so the
results differ by rounding, not bitwise. Ranks of one run agree bitwise."""
import pytest
import torch
import torch.distributed as dist

import distributed_helpers as dh

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with the gloo backend is not available in this torch")

REL_TOL = 1e-5


def reference(clip):
    """Single process, full batch, OffloadAdamW: what the ranks must reproduce."""
    model = dh.make_mlp()
    opt = dh.make_optimizer(model)
    norms, lrs = dh.train(model, opt, dh.make_batches(), clip=clip)
    return model, opt, norms, lrs


def assert_close_normwise(got, want, what):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    rel = float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))
    assert rel <= REL_TOL, f"{what}: normwise relative difference {rel:.3g} > {REL_TOL}"


def run_ranks(worker, tmp_path):
    dh.spawn(worker, dh.free_port(), str(tmp_path))
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(dh.WORLD_SIZE)]


def check_against_reference(ranks, ref_model, ref_norms, ref_lrs):
    ref = dict(ref_model.named_parameters())
    assert max(ref_norms) > dh.MAX_NORM, "clipping should be active in some steps (else the test misses it)"
    assert ref_lrs[0] < ref_lrs[3] and ref_lrs[-1] < ref_lrs[3], f"the schedule should warm up then decay: {ref_lrs}"
    init = dict(dh.make_mlp().named_parameters())
    for r, res in enumerate(ranks):
        assert res["lrs"] == pytest.approx(ref_lrs, rel=1e-12), f"rank {r} used other learning rates"
        assert res["norms"] == pytest.approx(ref_norms, rel=1e-5), f"rank {r}: gradient norms before clipping differ"
        assert sorted(res["params"]) == sorted(ref)
        for name, want in ref.items():
            got = res["params"][name]
            assert not torch.equal(got, init[name]), f"rank {r}: {name} was never updated"
            assert_close_normwise(got, want.detach(), f"rank {r} {name}")
    for name in ref:
        assert torch.equal(ranks[0]["params"][name], ranks[1]["params"][name]), f"{name} differs between the ranks"


def test_ddp_two_ranks_equal_single_process_full_batch(tmp_path):
    ranks = run_ranks(dh.ddp_worker, tmp_path)
    ref_model, _, ref_norms, ref_lrs = reference(clip="optimizer")
    check_against_reference(ranks, ref_model, ref_norms, ref_lrs)


def fully_shard_or_skip():
    try:
        return dh.import_fully_shard()
    except ImportError as e:
        pytest.skip(f"FSDP2 fully_shard is not importable from torch.distributed.fsdp or "
                    f"torch.distributed._composable.fsdp in torch {torch.__version__}: {e}")


@pytest.fixture(scope="module")
def fsdp2_ranks(tmp_path_factory):
    """One FSDP2 run (about 10-30 s) whose results both FSDP2 tests read."""
    fully_shard_or_skip()
    return run_ranks(dh.fsdp2_worker, tmp_path_factory.mktemp("fsdp2"))


def test_fsdp2_local_shards_equal_single_process_full_batch(fsdp2_ranks):
    ranks = fsdp2_ranks
    ref_model, ref_opt, ref_norms, ref_lrs = reference(clip="torch")
    check_against_reference(ranks, ref_model, ref_norms, ref_lrs)

    ref_state = {n: ref_opt.state[p] for n, p in ref_model.named_parameters()}
    for r, res in enumerate(ranks):
        for name, info in res["shards"].items():
            assert info["param_is_dtensor"], f"{name}: fully_shard should have made it a DTensor"
            assert info["param_local_numel"] < info["param_numel"], f"rank {r} {name}: not sharded"
            assert info["exp_avg_local_numel"] == info["param_local_numel"], (
                f"rank {r} {name}: exp_avg's local part has {info['exp_avg_local_numel']} elements "
                f"({info['exp_avg_type']} {info['exp_avg_local_shape']}), the local shard "
                f"{info['param_local_numel']} {info['param_local_shape']}")
            assert info["exp_avg_local_shape"] == info["param_local_shape"]
            assert info["step"] == dh.STEPS
    # the uneven shard (5 rows over 2 ranks) is really split 3 + 2
    last_bias = [res["shards"]["4.bias"]["param_local_numel"] for res in ranks]
    assert sorted(last_bias) == [2, 3], last_bias

    # state_dict() works under FSDP2: torch.optim.AdamW's keys; each rank's part of every state
    # tensor equals its rows of the reference's (FSDP2 shards dim 0 like torch.chunk)
    ref_sd = ref_opt.state_dict()
    for r, res in enumerate(ranks):
        sd = res["state_dict"]
        assert sd["state_keys"] == list(range(len(ref_state)))
        assert [g["params"] for g in sd["groups"]] == [g["params"] for g in ref_sd["param_groups"]]
        for got, want in zip(sd["groups"], ref_sd["param_groups"]):
            assert set(want) <= set(got), f"param group keys missing: {set(want) - set(got)}"
            assert got["lr"] == pytest.approx(want["lr"], rel=1e-12)
            assert got["weight_decay"] == want["weight_decay"]
        for name, want in ref_state.items():
            got = sd["state"][name]
            assert float(got["step"]) == float(want["step"]) == dh.STEPS
            for key in ("exp_avg", "exp_avg_sq"):
                rows = torch.chunk(want[key], dh.WORLD_SIZE, dim=0)[r]
                assert_close_normwise(got[key]["local"], rows, f"rank {r} state_dict {name} {key} (local part)")
            assert torch.equal(res["exp_avg_after_load"][name], got["exp_avg"]["local"]), (
                f"rank {r} {name}: exp_avg changed by loading the optimizer's own state dict back")


def test_fsdp2_state_dict_is_torch_adamw_format(fsdp2_ranks):
    """torch.optim.AdamW under FSDP2 keeps DTensor state shaped like the (global) DTensor
    parameter; distributed checkpointing and loading into torch.optim.AdamW rely on that.
    OffloadAdamW's state dict should look the same (the spec: 'torch.optim.AdamW's format',
    'shaped like p', 'loads into torch.optim.AdamW')."""
    for r, res in enumerate(fsdp2_ranks):
        assert res["load_into_torch_adamw_error"] is None, (
            f"rank {r}: torch.optim.AdamW could not load and step with OffloadAdamW's FSDP2 state dict: "
            f"{res['load_into_torch_adamw_error']}")
        for name, entry in res["state_dict"]["state"].items():
            full_shape = tuple(res["params"][name].shape)
            for key in ("exp_avg", "exp_avg_sq"):
                assert (entry[key]["type"], entry[key]["shape"]) == ("DTensor", full_shape), (
                    f"rank {r} {name} {key}: a {entry[key]['type']} of shape {entry[key]['shape']} in the state "
                    f"dict; torch.optim.AdamW's is a DTensor of the parameter's shape {full_shape}")
