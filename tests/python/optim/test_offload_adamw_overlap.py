"""OffloadAdamW(overlap="backward") (issue 26; Note [speculative step] in
hipferry/optim/speculation.py): parameters stepped on the CPU are stepped
speculatively during backward and committed or redone at step(). The oracle
is the same optimizer without overlap, bit for bit (hipferry owns both
sides), over 20 steps of a small transformer; the counters show that the
speculation was used where it could be and redone where it had to be.
"remote": CPU parameters through the CPU engine's path for GPU parameters
(the `cpu-remote` seam: gradient copies to the host from the hooks, host
working copies, copies back), so that path is proven without a GPU."""
import contextlib

import pytest
import torch

from hipferry.optim import OffloadAdamW
from conftest import requires_gpu
from offload_adamw_helpers import CpuRemoteOffloadAdamW

STEPS = 20
FIRES = {0, 3, 6, 9, 12, 15, 18}  # steps whose clipping scales the gradients


def make_model(dtype):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True),
                                torch.nn.Linear(32, 8))
    return model.to(dtype)


def batches(dtype, n):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 6, 32, generator=g).to(dtype) for _ in range(n)]


def loss_of(model, x):
    return model(x).float().pow(2).mean()


def assert_same(a_model, a_opt, b_model, b_opt):
    for (name, x), y in zip(a_model.named_parameters(), b_model.parameters()):
        assert torch.equal(x, y), name
    for p, q in zip(a_model.parameters(), b_model.parameters()):
        for k, t in a_opt.state[p].items():
            assert torch.equal(t, b_opt.state[q][k]), k


def train(overlap, dtype, *, clip=True, micro=1, use_accumulating=True, inject_inf_at=None, scaler=False,
          remote=False, amsgrad=False):
    model = make_model(dtype)
    cls = CpuRemoteOffloadAdamW if remote else OffloadAdamW
    opt = cls(model.parameters(), lr=1e-2, weight_decay=0.1, overlap=overlap, step_on="cpu", amsgrad=amsgrad)
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if scaler else None
    data = batches(dtype, STEPS * micro)
    for step in range(STEPS):
        for k in range(micro):
            last = k == micro - 1
            ctx = opt.accumulating() if use_accumulating and not last else contextlib.nullcontext()
            with ctx:
                loss = loss_of(model, data[step * micro + k]) / micro
                (grad_scaler.scale(loss) if grad_scaler else loss).backward()
        if inject_inf_at == step:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        if grad_scaler:
            grad_scaler.step(opt)
            grad_scaler.update()
        else:
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05 if step in FIRES else 1e6)
            opt.step()
        opt.zero_grad()
    return model, opt


@pytest.mark.parametrize("remote", [False, True], ids=["cpu", "cpu-remote"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_steps_with_clipping_that_fires_sometimes_are_bit_identical(dtype, remote):
    ref_model, ref_opt = train(None, dtype, remote=remote)
    model, opt = train("backward", dtype, remote=remote)
    assert_same(ref_model, ref_opt, model, opt)
    n = len(list(model.parameters()))
    s = opt.overlap_stats()
    first = 1 if remote else 0  # (remote: the first step makes the host working copies; nothing to speculate on)
    assert s["started"] == (STEPS - first) * n
    assert s["committed"] == (STEPS - len(FIRES)) * n, s        # clipping with factor 1 leaves the bits: kept
    assert s["redone"] == (len(FIRES) - first) * n, s            # clipping that fired: redone from the state


@pytest.mark.parametrize("remote", [False, True], ids=["cpu", "cpu-remote"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_amsgrad_steps_are_bit_identical(dtype, remote):
    """The speculative step reads m, v and max_v from the state and writes them to scratch."""
    ref_model, ref_opt = train(None, dtype, remote=remote, amsgrad=True)
    model, opt = train("backward", dtype, remote=remote, amsgrad=True)
    assert_same(ref_model, ref_opt, model, opt)
    assert opt.overlap_stats()["committed"] > 0


@pytest.mark.parametrize("remote", [False, True], ids=["cpu", "cpu-remote"])
@pytest.mark.parametrize("use_accumulating", [True, False])
def test_two_micro_batches_step_once_bit_identically(use_accumulating, remote):
    ref_model, ref_opt = train(None, torch.float32, micro=2, remote=remote)
    model, opt = train("backward", torch.float32, micro=2, use_accumulating=use_accumulating, remote=remote)
    assert_same(ref_model, ref_opt, model, opt)
    n = len(list(model.parameters()))
    s = opt.overlap_stats()
    first = 1 if remote else 0
    # accumulating(): the first micro-batch starts nothing; without it, its speculation is replaced.
    assert s["started"] == (1 if use_accumulating else 2) * (STEPS - first) * n, s
    assert s["committed"] == (STEPS - len(FIRES)) * n, s


@pytest.mark.parametrize("remote", [False, True], ids=["cpu", "cpu-remote"])
def test_grad_scaler_with_an_injected_inf_skips_that_step_bit_identically(remote):
    ref_model, ref_opt = train(None, torch.float32, scaler=True, inject_inf_at=7, remote=remote)
    model, opt = train("backward", torch.float32, scaler=True, inject_inf_at=7, remote=remote)
    assert_same(ref_model, ref_opt, model, opt)
    assert opt.skipped_steps == ref_opt.skipped_steps == 1
    # Speculations unscale their snapshots by the last step's factor: all kept but where the scale
    # was not yet known (the first step) or changed (the step after the inf, whose backoff halved it).
    n = len(list(model.parameters()))
    s = opt.overlap_stats()
    assert s["committed"] == (STEPS - 3) * n, s
    assert s["redone"] == (1 if remote else 2) * n, s


class FailsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("backward fails halfway")


def test_an_exception_halfway_through_backward_leaves_no_parameter_half_stepped():
    ref_model, ref_opt = train(None, torch.float32)
    model, opt = train("backward", torch.float32)
    params_before = [p.detach().clone() for p in model.parameters()]
    state_before = [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()]
    started = opt.overlap_stats()["started"]
    x = batches(torch.float32, 1)[0]
    # backward reaches the parameters first, then the input's Function, which fails
    h = model[0](FailsInBackward.apply(x.clone().requires_grad_(True)))
    loss = model[1](h).pow(2).mean()
    with pytest.raises(RuntimeError, match="backward fails halfway"):
        loss.backward()
    assert opt.overlap_stats()["started"] > started  # speculative steps began before the failure
    opt.zero_grad()
    for p, before, st in zip(model.parameters(), params_before, state_before):
        assert torch.equal(p, before)
        assert all(torch.equal(opt.state[p][k], v) for k, v in st.items())
    # Training goes on exactly as the reference does.
    for m, o in ((ref_model, ref_opt), (model, opt)):
        loss_of(m, x).backward()
        o.step()
        o.zero_grad()
    assert_same(ref_model, ref_opt, model, opt)


def test_state_dict_and_load_state_dict_between_backward_and_step():
    ref_model, ref_opt = train(None, torch.float32)
    model, opt = train("backward", torch.float32)
    x = batches(torch.float32, 1)[0]
    loss_of(model, x).backward()
    saved = opt.state_dict()  # while speculations are pending
    opt.load_state_dict(saved)  # drops them: the step below is the ordinary one
    opt.step()
    loss_of(ref_model, x).backward()
    ref_opt.step()
    assert_same(ref_model, ref_opt, model, opt)
    assert ref_opt.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]


def run_with_writes_after_backward(overlap, dtype, remote, writes):
    """6 steps; `writes[step](model, opt)` runs between that step's backward and step()."""
    model = make_model(dtype)
    cls = CpuRemoteOffloadAdamW if remote else OffloadAdamW
    opt = cls(model.parameters(), lr=1e-2, weight_decay=0.1, overlap=overlap, step_on="cpu")
    for step, x in enumerate(batches(dtype, 6)):
        loss_of(model, x).backward()
        if step in writes:
            writes[step](model, opt)
        opt.step()
        opt.zero_grad()
    return model, opt


def halve_first_param(how):
    def write(model, opt):
        p = next(model.parameters())
        if how == "mul_under_no_grad":
            with torch.no_grad():
                p.mul_(0.5)
        else:
            p.data.mul_(0.5)
            opt.reload_params([p])
    return write


def change_first_state(how):
    def write(model, opt):
        st = opt.state[next(model.parameters())]
        if how == "zero_":
            st["exp_avg"].zero_()
        else:
            st["exp_avg_sq"] = st["exp_avg_sq"].clone().mul_(4)
    return write


@pytest.mark.parametrize("remote", [False, True], ids=["cpu", "cpu-remote"])
@pytest.mark.parametrize("write", ["mul_under_no_grad", "data_mul+reload_params"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_parameter_written_between_backward_and_step_is_redone(dtype, write, remote):
    """The write lands between the speculative step and step(): that parameter is redone from
    the written values (param_key shows the first write; reload_params() says the second)."""
    writes = dict.fromkeys((2, 4), halve_first_param(write))
    ref_model, ref_opt = run_with_writes_after_backward(None, dtype, remote, writes)
    model, opt = run_with_writes_after_backward("backward", dtype, remote, writes)
    assert_same(ref_model, ref_opt, model, opt)
    assert opt.overlap_stats()["redone"] == 2 and opt.overlap_stats()["committed"] > 0


@pytest.mark.parametrize("remote", [False, True], ids=["cpu", "cpu-remote"])
@pytest.mark.parametrize("write", ["zero_", "replace"])
def test_state_written_between_backward_and_step_is_redone(write, remote):
    """opt.state[p] changed after the speculative step read it (a callback that resets a
    moment, or puts a tensor in its place): that parameter steps from the state as it is now."""
    writes = {3: change_first_state(write)}
    ref_model, ref_opt = run_with_writes_after_backward(None, torch.float32, remote, writes)
    model, opt = run_with_writes_after_backward("backward", torch.float32, remote, writes)
    assert_same(ref_model, ref_opt, model, opt)
    assert opt.overlap_stats()["redone"] == 1


def test_a_hyperparameter_changed_after_backward_is_redone():
    ref_model, ref_opt = train(None, torch.float32, clip=False)
    model, opt = train("backward", torch.float32, clip=False)
    x = batches(torch.float32, 1)[0]
    committed = opt.overlap_stats()["committed"]
    for m, o in ((ref_model, ref_opt), (model, opt)):
        loss_of(m, x).backward()
        o.param_groups[0]["lr"] = 3e-3  # after the speculation started
        o.step()
    assert_same(ref_model, ref_opt, model, opt)
    assert opt.overlap_stats()["committed"] == committed


def test_bad_overlap_is_rejected():
    with pytest.raises(ValueError, match="overlap must be None or 'backward'"):
        OffloadAdamW([torch.nn.Parameter(torch.zeros(3))], overlap="forward")


requires_gloo = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                   reason="torch.distributed with the gloo backend is not available in this torch")


def ranks_equal_to_the_plain_run(tmp_path) -> list:
    """Asserts that each rank's overlapped run equals its plain run bit for bit (norms,
    parameters, state); returns each rank's (plain, overlapped) records."""
    import distributed_helpers as dh
    out = []
    for rank in range(dh.WORLD_SIZE):
        runs = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        plain, overlapped = runs["None"], runs["backward"]
        assert plain["norms"] == overlapped["norms"]
        for name, want in plain["params"].items():
            assert torch.equal(overlapped["params"][name], want), f"rank {rank}: {name}"
            for k, t in plain["state"][name].items():
                assert torch.equal(overlapped["state"][name][k], t), f"rank {rank}: {name} {k}"
        out.append((plain, overlapped))
    return out


def check_ranks_against_the_plain_run(tmp_path, started_steps):
    """Each rank's overlapped run equals its plain run bit for bit; every step started
    `started_steps` speculations per parameter, kept where clipping left the reduced gradient,
    redone where it fired."""
    import distributed_helpers as dh
    for plain, overlapped in ranks_equal_to_the_plain_run(tmp_path):
        s = overlapped["stats"]
        n_params = len(plain["params"])
        fired = sum(norm > dh.MAX_NORM for norm in plain["norms"])
        assert 0 < fired < dh.STEPS, f"clipping must fire in some steps only: {plain['norms']}"
        assert s["started"] == started_steps * dh.STEPS * n_params, s
        assert s["committed"] == (dh.STEPS - fired) * n_params and s["redone"] == fired * n_params, s


@requires_gloo
def test_ddp_two_ranks_with_the_comm_hook_are_bit_identical_to_ddp_without_overlap(tmp_path):
    import distributed_helpers as dh
    dh.spawn(dh.ddp_overlap_worker, dh.free_port(), str(tmp_path))
    check_ranks_against_the_plain_run(tmp_path, started_steps=1)  # from the reduced gradients


def test_hf_trainer_with_max_grad_norm_is_bit_identical(tmp_path):
    transformers = pytest.importorskip("transformers")
    from hf_model_helpers import batch, make_model

    def run(overlap, out):
        model = make_model("llama")
        args = transformers.TrainingArguments(
            output_dir=str(out), use_cpu=True, max_steps=20, per_device_train_batch_size=2, report_to=[],
            save_strategy="no", logging_steps=1, seed=0, max_grad_norm=2.7, learning_rate=1e-2)
        data = [{"input_ids": ids, "labels": ids} for ids in batch(0, batch=8)]
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                       optimizer_cls_and_kwargs=(OffloadAdamW, {"overlap": overlap}))
        trainer.train()
        norms = [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e]
        return model, trainer.optimizer, norms

    ref_model, _, norms = run(None, tmp_path / "plain")
    model, opt, overlapped_norms = run("backward", tmp_path / "overlap")
    assert norms == overlapped_norms and len(norms) == 20
    for (name, x), y in zip(ref_model.named_parameters(), model.parameters()):
        assert torch.equal(x, y), name
    inner = getattr(opt, "optimizer", opt)  # (Trainer may wrap it in accelerate's AcceleratedOptimizer)
    s = inner.overlap_stats()
    fired = sum(n > 2.7 for n in norms)
    assert 0 < fired < 20, norms  # clipping fires in some steps, not all
    assert s["committed"] > 0 and s["redone"] > 0, s


@requires_gloo
def test_fsdp2_two_ranks_are_bit_identical_to_fsdp2_without_overlap(tmp_path):
    import distributed_helpers as dh
    try:
        dh.import_fully_shard()
    except ImportError as e:
        pytest.skip(f"FSDP2 fully_shard is not importable in torch {torch.__version__}: {e}")
    dh.spawn(dh.fsdp2_overlap_worker, dh.free_port(), str(tmp_path))
    # FSDP2 runs the sharded parameters' post-accumulate-grad hooks once their reduced gradient is assigned.
    check_ranks_against_the_plain_run(tmp_path, started_steps=1)


def forward_reads(overlap, device, remote):
    """What every forward of 8 steps read: the parameters as a forward pre-hook sees them.
    On a GPU the copies back are asynchronous: a forward that ran before its parameters'
    update landed would read other values than the run without overlap."""
    model = make_model(torch.float32).to(device)
    cls = CpuRemoteOffloadAdamW if remote else OffloadAdamW
    opt = cls(model.parameters(), lr=1e-2, overlap=overlap, step_on="cpu", min_offload_numel=0)
    reads = []
    model.register_forward_pre_hook(lambda m, args: reads.append([p.detach().clone() for p in m.parameters()]))
    for step, x in enumerate(batches(torch.float32, 8)):
        loss_of(model, x.to(device)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05 if step in FIRES else 1e6)
        opt.step()
        opt.zero_grad()
    return [[t.cpu() for t in r] for r in reads], opt


@pytest.mark.parametrize("device, remote", [("cpu", False), ("cpu", True),
                                            pytest.param("cuda", False, marks=requires_gpu)],
                         ids=["cpu", "cpu-remote", "cuda"])
def test_every_forward_reads_the_parameters_its_step_left(device, remote):
    plain, _ = forward_reads(None, device, remote)
    overlapped, opt = forward_reads("backward", device, remote)
    assert len(plain) == len(overlapped) == 8
    for step, (want, got) in enumerate(zip(plain, overlapped)):
        assert all(torch.equal(a, b) for a, b in zip(want, got)), f"forward {step} read other parameters"
    assert opt.overlap_stats()["committed"] > 0


# ----------------------------------------------------------------- the commit's bit comparison
@pytest.mark.parametrize("numel", [0, 1, 7, 1 << 16, (1 << 20) + 3])
def test_bits_equal_sees_any_one_flipped_bit(numel):
    """_C._bits_equal (the commit test, split over torch's threads) against the bits themselves."""
    from hipferry import _C
    a = torch.randn(numel)
    assert _C._bits_equal(a, a.clone())
    for pos in sorted({0, numel // 2, numel - 1}) if numel else []:
        b = a.clone()
        b.view(torch.int32)[pos] ^= 1 << (pos % 32)
        assert not _C._bits_equal(a, b), pos
    if numel:  # bits, not values: -0.0 differs from 0.0, a NaN equals its own bits
        zeros, nans = torch.zeros(numel), torch.full((numel,), float("nan"))
        assert not _C._bits_equal(zeros, -zeros) and _C._bits_equal(nans, nans.clone())


def test_bits_equal_rejects_what_it_cannot_compare():
    from hipferry import _C
    a = torch.randn(4, 4)
    with pytest.raises(ValueError, match="a must be a contiguous dense CPU tensor"):
        _C._bits_equal(a.t(), a)
    with pytest.raises(ValueError, match="a has 64 bytes and b 32"):
        _C._bits_equal(a, torch.zeros(8))
    assert _C._bits_equal(a, a.view(torch.int32).clone())  # (any dtypes of as many bytes)
