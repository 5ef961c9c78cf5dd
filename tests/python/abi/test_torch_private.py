"""hipferry.torch_private (Note [private torch names]): each wrapper of a private
torch name checked against the installed torch -- a torch release that renames,
removes or changes one fails here, in the test named after the wrapper -- and
no other package source spells a private torch name."""
import inspect
import re
from collections import OrderedDict, UserDict, namedtuple
from pathlib import Path

import pytest
import torch
from torch import nn

from hipferry import torch_private as tp

Pair = namedtuple("Pair", "x y")
PACKAGE = Path(__file__).resolve().parents[3] / "python" / "hipferry"  # the sources, wherever hipferry is imported from


class Probe(torch.autograd.Function):
    """Identity whose backward runs `probe()` and records what it returned in `seen`."""

    @staticmethod
    def forward(ctx, x, probe, seen):
        ctx.probe, ctx.seen = probe, seen
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.seen.append(ctx.probe())
        return g, None, None


# ------------------------------------------------------------------ autograd engine
def test_current_graph_task_id_and_in_backward():
    assert tp.current_graph_task_id() == -1 and tp.in_backward() is False
    seen = []
    x = torch.ones(3, requires_grad=True)
    Probe.apply(x, lambda: (tp.current_graph_task_id(), tp.in_backward()), seen).sum().backward()
    Probe.apply(x, lambda: (tp.current_graph_task_id(), tp.in_backward()), seen).sum().backward()
    (first, in_first), (second, in_second) = seen
    assert isinstance(first, int) and first != -1 and in_first is True
    assert second != first, "each backward is a graph task of its own"
    assert in_second is True
    assert tp.current_graph_task_id() == -1 and tp.in_backward() is False


def test_queue_end_of_backward():
    order = []

    def queue():
        tp.queue_end_of_backward(lambda: order.append("end of backward"))
        return "queued"

    x = torch.ones(3, requires_grad=True)
    y = Probe.apply(x, queue, order)              # runs last in backward (nearest the leaf)
    z = Probe.apply(y * 2, lambda: "first", order)  # runs first
    z.sum().backward()
    assert order == ["first", "queued", "end of backward"], order
    with pytest.raises(RuntimeError):  # only from inside a backward
        tp.queue_end_of_backward(lambda: None)


def test_post_accumulate_grad_hooks():
    p = nn.Parameter(torch.ones(2))
    assert tp.post_accumulate_grad_hooks(p) == []
    calls = []
    h1, h2 = (lambda q: calls.append(1)), (lambda q: calls.append(2))
    handle1 = p.register_post_accumulate_grad_hook(h1)
    p.register_post_accumulate_grad_hook(h2)
    assert tp.post_accumulate_grad_hooks(p) == [h1, h2]
    (p * 3).sum().backward()
    assert calls == [1, 2], "torch runs the hooks in the order returned"
    handle1.remove()
    assert tp.post_accumulate_grad_hooks(p) == [h2]


def test_current_saved_tensors_hooks():
    assert tp.current_saved_tensors_hooks() is None
    outer = (lambda t: ("outer", t), lambda packed: packed[1])
    inner = (lambda t: ("inner", t), lambda packed: packed[1])
    with torch.autograd.graph.saved_tensors_hooks(*outer):
        got = tp.current_saved_tensors_hooks()
        assert got[0] is outer[0] and got[1] is outer[1]
        with torch.autograd.graph.saved_tensors_hooks(*inner):
            got = tp.current_saved_tensors_hooks()
            assert got[0] is inner[0] and got[1] is inner[1]
        got = tp.current_saved_tensors_hooks()
        assert got[0] is outer[0]
    assert tp.current_saved_tensors_hooks() is None


def test_is_dtype_cast_node():
    w = torch.ones(4, requires_grad=True)
    assert tp.is_dtype_cast_node(w.to(torch.bfloat16).grad_fn)
    weight = torch.ones(3, 4, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the cast autocast makes of a weight
        y = nn.functional.linear(torch.ones(2, 4), weight)
    nodes, todo = [], [y.grad_fn]
    while todo:  # the graph back to the leaf
        fn = todo.pop()
        nodes.append(fn)
        todo += [f for f, _ in fn.next_functions if f is not None]
    casts = [fn for fn in nodes if tp.is_dtype_cast_node(fn)]
    assert len(casts) == 1, [type(fn).__name__ for fn in nodes]  # the weight's (the input needs no grad)
    assert casts[0].next_functions[0][0].variable is weight
    assert not tp.is_dtype_cast_node((w * 2).grad_fn)
    assert not tp.is_dtype_cast_node(w.view(2, 2).grad_fn)
    assert not tp.is_dtype_cast_node(None)


# ------------------------------------------------------------------ tensors
def test_tensor_version():
    t = torch.zeros(4)
    v0 = tp.tensor_version(t)
    assert isinstance(v0, int)
    t.add_(1)
    assert tp.tensor_version(t) == v0 + 1
    t.view(2, 2).mul_(2)  # a view shares the counter
    assert tp.tensor_version(t) == v0 + 2
    _ = t + 1
    assert tp.tensor_version(t) == v0 + 2, "out-of-place ops do not count"
    assert tp.tensor_version(t.detach()) == v0 + 2


def test_tensor_base():
    base = torch.zeros(4, 4)
    row = base[1]
    assert tp.tensor_base(base) is None
    assert tp.tensor_base(row) is base
    assert tp.tensor_base(row[1:]) is base, "a view of a view points at the first base"
    assert tp.tensor_base(base.clone()) is None


def test_storage_holders_and_same_storage():
    t = torch.zeros(4, 4)
    assert tp.storage_holders(t) == 1
    row = t[1]
    assert tp.storage_holders(t) == 2 and tp.same_storage(t, row)
    data, array = t.data, t.numpy()
    assert tp.storage_holders(t) == 4, "a .data alias and a numpy array hold it too"
    del row, data, array
    assert tp.storage_holders(t) == 1
    other = torch.zeros(4, 4)
    assert not tp.same_storage(t, other)
    other.set_(t.untyped_storage(), 0, (4, 4), (4, 1))
    assert tp.same_storage(t, other) and tp.storage_holders(t) == 2


def test_eager_dispatch():
    from torch.utils._python_dispatch import TorchDispatchMode
    assert tp.eager_dispatch()

    class Passing(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Passing():
        assert not tp.eager_dispatch()
    assert tp.eager_dispatch()
    seen = []

    def traced(x):
        seen.append(tp.eager_dispatch())
        return x + 1

    torch.compile(traced, backend="eager", fullgraph=True)(torch.zeros(2))
    assert seen == [False], "torch.compile traces it as not eager"


def test_neg_view():
    t = torch.tensor([1.0, -2.0, 3.0])
    n = tp.neg_view(t)
    assert n.is_neg() and not t.is_neg()
    assert n.data_ptr() == t.data_ptr(), "a view, not a copy"
    assert torch.equal(n.resolve_neg(), -t)
    t[0] = 5.0
    assert float(n[0]) == -5.0


def test_amp_unscale_():
    grads = [torch.tensor([2.0, 4.0]), torch.tensor([1.0, 8.0])]
    found = torch.zeros(())
    tp.amp_unscale_(grads, found, torch.tensor(0.5))
    assert torch.equal(grads[0], torch.tensor([1.0, 2.0])) and torch.equal(grads[1], torch.tensor([0.5, 4.0]))
    assert float(found) == 0.0
    grads = [torch.tensor([2.0, float("inf")])]
    tp.amp_unscale_(grads, found, torch.tensor(0.5))
    assert float(found) == 1.0


def test_host_empty_cache():
    got = tp.host_empty_cache()
    assert isinstance(got, bool)
    assert got == hasattr(torch._C, "_host_emptyCache")
    if torch.__version__ >= "2.5":  # the call exists there: False would mean torch renamed it
        assert got is True


def test_dtensor_local():
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, distribute_tensor, init_device_mesh
    assert tp.dtensor_local(torch.ones(2)) is None
    assert tp.dtensor_local(nn.Parameter(torch.ones(2))) is None
    ours = not dist.is_initialized()
    if ours:  # a one-rank group in this process
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        d = distribute_tensor(torch.arange(4.0), init_device_mesh("cpu", (1,)), [Replicate()])
        shard = tp.dtensor_local(d)
        assert type(shard) is torch.Tensor and torch.equal(shard, torch.arange(4.0))
        shard[0] = 7.0  # the shard itself, not a copy
        assert float(d.to_local()[0]) == 7.0
        p = nn.Parameter(d)
        assert tp.dtensor_local(p) is not None and float(tp.dtensor_local(p)[0]) == 7.0
    finally:
        if ours:
            dist.destroy_process_group()


# ------------------------------------------------------------------ modules
def test_module_parameters():
    outer = nn.Sequential(nn.Linear(2, 3))
    lin = outer[0]
    slots = tp.module_parameters(lin)
    assert list(slots) == ["weight", "bias"] and slots["weight"] is lin.weight
    assert list(tp.module_parameters(outer)) == [], "a module's own parameters only"
    stand_in = torch.full((3, 2), 7.0)  # a plain tensor in a slot: what hipferry does while a block runs
    slots["weight"] = stand_in
    assert lin.weight is stand_in, "the live dict: a module reads its parameters from it"
    assert torch.equal(lin(torch.ones(1, 2)), stand_in.sum(1, keepdim=True).t() + lin.bias)


def test_module_buffers():
    bn = nn.BatchNorm1d(3)
    slots = tp.module_buffers(bn)
    assert list(slots) == ["running_mean", "running_var", "num_batches_tracked"]
    assert slots["running_mean"] is bn.running_mean
    slots["running_mean"] = torch.ones(3)
    assert torch.equal(bn.running_mean, torch.ones(3)), "the live dict"


def test_module_hook_dicts():
    m = nn.Linear(2, 2)
    pre, fwd, post = (lambda *a: None), (lambda *a: None), (lambda *a: None)
    handles = [m.register_forward_pre_hook(pre), m.register_forward_hook(fwd), m.register_state_dict_post_hook(post)]
    dicts = tp.module_hook_dicts(m)
    assert len(dicts) == 3
    for d, handle, hook in zip(dicts, handles, (pre, fwd, post)):
        assert d[handle.id] is hook
        handle.remove()
        assert handle.id not in d, "the dicts the handles remove from"


def test_module_apply():
    m = nn.Sequential(nn.Linear(2, 2))
    seen = []

    def convert(t):
        seen.append(t.shape)
        return t.double()

    assert tp.module_apply(m, convert) is m
    assert m[0].weight.dtype == torch.float64 and len(seen) == 2, "weight and bias, recursing"
    seen.clear()
    tp.module_apply(m, convert, recurse=False)
    assert seen == [], "the Sequential's own tensors only: none"


def test_override_module_apply():
    m = nn.Linear(2, 2)
    calls = []

    def instead(fn, recurse=True):
        calls.append(recurse)
        return tp.module_apply(m, fn, recurse)  # torch's, bypassing the override

    tp.override_module_apply(m, instead)
    assert m.__dict__[tp.MODULE_APPLY] is instead
    m.to(torch.float16)
    assert calls == [True] and m.weight.dtype == torch.float16, "model.to() calls the override"
    m.float()
    assert len(calls) == 2
    del m.__dict__[tp.MODULE_APPLY]
    m.double()
    assert len(calls) == 2 and m.weight.dtype == torch.float64, "torch's own again"


# ------------------------------------------------------------------ optimizers
def test_optimizer_load_state_dict_hooks():
    p = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    assert tp.optimizer_load_state_dict_hooks(opt) == ([], [])
    order = []
    pre1, pre2, post = (lambda o, sd: order.append("pre1")), (lambda o, sd: order.append("pre2")), \
        (lambda o: order.append("post"))
    h = opt.register_load_state_dict_pre_hook(pre1)
    opt.register_load_state_dict_pre_hook(pre2, prepend=True)
    opt.register_load_state_dict_post_hook(post)
    assert tp.optimizer_load_state_dict_hooks(opt) == ([pre2, pre1], [post])
    opt.load_state_dict(opt.state_dict())
    assert order == ["pre2", "pre1", "post"], "the order torch runs them in"
    h.remove()
    assert tp.optimizer_load_state_dict_hooks(opt) == ([pre2], [post])


def test_supports_amp_scaling():
    @tp.supports_amp_scaling
    class Plain(torch.optim.SGD):
        seen = None

        def step(self, closure=None):
            Plain.seen = (float(self.grad_scale), float(self.found_inf))  # set by GradScaler, not unscaled by it

    p = nn.Parameter(torch.ones(2))
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    opt = Plain([p], lr=0.1)
    scaler.scale((p * 1.0).sum()).backward()
    scaler.step(opt)
    assert Plain.seen == (4.0, 0.0) and torch.equal(p.grad, torch.full((2,), 4.0)), "grads left scaled"
    plain = torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1)
    assert not getattr(plain, "_step_supports_amp_scaling", False)


# ------------------------------------------------------------------ containers
def test_tree_flatten_and_tree_unflatten():
    t = [torch.full((1,), float(i)) for i in range(6)]
    mapping = UserDict(k=t[5])
    trees = [{"a": t[0], "b": [t[1], (t[2], Pair(t[3], t[4]))]}, Pair(t[0], {"z": t[1], "a": t[2]}),
             OrderedDict(second=t[0], first=t[1]), [t[0], mapping], t[0]]
    for tree in trees:
        leaves, spec = tp.tree_flatten(tree)
        assert all(isinstance(x, torch.Tensor) or x is mapping for x in leaves)
        back = tp.tree_unflatten(leaves, spec)
        assert tp.tree_flatten(back)[1] == spec and type(back) is type(tree)
        assert all(a is b for a, b in zip(tp.tree_flatten(back)[0], leaves))
    assert tp.tree_flatten(trees[0])[0] == [t[0], t[1], t[2], t[3], t[4]], "in key order, depth first"
    assert list(tp.tree_unflatten(*tp.tree_flatten(trees[1]))[1]) == ["z", "a"], "dict order kept"
    assert tp.tree_flatten([t[0], mapping])[0][1] is mapping, "a Mapping pytree does not know is a leaf"
    leaves, _ = tp.tree_flatten([[t[0]], (t[1],)], is_leaf=lambda x: isinstance(x, tuple))
    assert leaves[0] is t[0] and leaves[1] == (t[1],)


def test_tree_leaf_paths():
    t = torch.ones(1)
    assert tp.tree_leaf_paths({"a": [t, (t, t)], "b": Pair(t, t)}) == [
        "['a'][0]", "['a'][1][0]", "['a'][1][1]", "['b'].x", "['b'].y"]
    assert tp.tree_leaf_paths(t) == [""]


def test_tree_is_leaf():
    for leaf in (torch.ones(1), 3, None, "s", UserDict(a=1)):
        assert tp.tree_is_leaf(leaf), type(leaf)
    for node in ({}, [], (), Pair(1, 2), OrderedDict()):
        assert not tp.tree_is_leaf(node), type(node)


class Box:
    """A mapping-like class of the test's own, registered once."""

    def __init__(self, keys, values, tag):
        self.keys, self.values, self.tag = keys, values, tag


tp.register_mapping_node(Box, lambda b: (b.keys, b.values, (b.keys, b.tag)),
                         lambda values, context: Box(context[0], values, context[1]))


def test_register_mapping_node():
    t = [torch.full((1,), float(i)) for i in range(3)]
    box = Box(["w", 7], [t[0], [t[1], t[2]]], tag="kept")
    assert not tp.tree_is_leaf(box)
    leaves, spec = tp.tree_flatten({"box": box})
    assert leaves == [t[0], t[1], t[2]]
    back = tp.tree_unflatten([x * 2 for x in leaves], spec)["box"]
    assert type(back) is Box and back.keys == ["w", 7] and back.tag == "kept"
    assert torch.equal(back.values[0], t[0] * 2) and isinstance(back.values[1], list)
    assert tp.tree_leaf_paths({"box": box}) == ["['box']['w']", "['box'][7][0]", "['box'][7][1]"]


def test_every_wrapper_has_its_test():
    wrappers = [name for name, f in inspect.getmembers(tp, inspect.isfunction)
                if f.__module__ == tp.__name__ and not name.startswith("_")]
    tests = [name for name in globals() if name.startswith("test_")]
    untested = [w for w in wrappers if not any(re.search(rf"(^test_|_and_){w}(_and_|$)", t) for t in tests)]
    assert not untested, f"torch_private functions without a test_<name> here: {untested}"


# ------------------------------------------------------------------ nowhere else
PRIVATE_NAMES = [
    r"torch\._[A-Za-z]",                  # torch._C, torch._neg_view, torch._amp_...
    r"torch\.utils\._", r"\b_pytree\b",   # torch.utils._pytree, however imported
    r"from\s+torch[\w.]*\s+import\s+[^#\n]*\b_[A-Za-z]",
    r"\._version\b", r"\._base\b",
    r"_post_accumulate_grad_hooks", r"_execution_engine", r"_top_saved_tensors",
    r"Backward0",                         # autograd node class names
    r"\._parameters\b", r"\._buffers\b",
    r"\._forward(_pre)?_hooks\b", r"\._state_dict_hooks\b",
    r"\b_local_tensor\b",                  # DTensor's shard, also as getattr(t, "_local_tensor")
    r"\b_apply\b",                         # nn.Module._apply, and overriding it ("_apply")
    r"\b_optimizer_\w+",                   # Optimizer._optimizer_load_state_dict_pre_hooks and kin
    r"\b_step_supports_amp_scaling\b",     # the attribute GradScaler reads
]


def private_name_uses(root: Path):
    """'file:line: text' for each line of the package outside torch_private.py
    that spells a private torch name."""
    pattern = re.compile("|".join(f"(?:{p})" for p in PRIVATE_NAMES))
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "torch_private.py" and path.parent == root:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                found.append(f"{path.relative_to(root.parent)}:{n}: {line.strip()}")
    return found


def test_private_name_grep_finds_them(tmp_path):
    # The check below must be able to fail: each kind of use is found.
    pkg = tmp_path / "hipferry"
    pkg.mkdir()
    uses = ["torch._C._current_graph_task_id()", "from torch.utils import _pytree", "t._version", "t._base",
            "p._post_accumulate_grad_hooks", "Variable._execution_engine", "ToCopyBackward0", "m._parameters",
            "m._buffers", "m._forward_pre_hooks", "m._state_dict_hooks", "torch._neg_view(x)",
            'getattr(t, "_local_tensor", None)', "nn.Module._apply(m, fn)", 'm.__dict__["_apply"] = f',
            "opt._optimizer_load_state_dict_pre_hooks", "_step_supports_amp_scaling = True"]
    (pkg / "uses.py").write_text("\n".join(uses) + "\nx = torch.__version__\nt.version = 1\n"
                                 "_apply_except(m)\nself.local_tensor = t\n")  # (not private torch names)
    (pkg / "torch_private.py").write_text("torch._C\n")
    assert [u.split(": ", 1)[1] for u in private_name_uses(pkg)] == uses


def test_no_private_torch_names_outside_torch_private():
    assert (PACKAGE / "torch_private.py").is_file(), PACKAGE
    offenders = private_name_uses(PACKAGE)
    assert not offenders, ("private torch names outside hipferry/torch_private.py (add a wrapper there):\n  "
                           + "\n  ".join(offenders))
