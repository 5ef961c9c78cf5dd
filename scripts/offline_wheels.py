"""Prints the pure-Python (and small binary) distributions that the GPU check
needs beyond torch, with their requirements resolved from what is installed
here: `scripts/dev.sh gpu-wheels` downloads them into .whl/ for a GPU machine
without network, where scripts/gpu_check.sh installs them (so the Hugging Face
suite, opcheck and the accelerate baseline run there too). torch and what it
brings are left out: the GPU machine has its own."""
import re
import sys
from importlib.metadata import PackageNotFoundError, requires

from packaging.markers import default_environment
from packaging.requirements import Requirement

ROOTS = ["transformers", "peft", "accelerate", "expecttest"]
TORCH_OWN = {"torch", "numpy", "triton", "sympy", "networkx", "jinja2", "markupsafe", "mpmath", "filelock",
             "fsspec", "typing-extensions", "setuptools"}


def main() -> int:
    env = default_environment()
    seen, todo = set(), list(ROOTS)
    while todo:
        name = todo.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen or key in TORCH_OWN or key.startswith("nvidia-"):
            continue
        try:
            reqs = requires(name) or []
        except PackageNotFoundError:
            print(f"offline_wheels: {name} is not installed here; run scripts/dev.sh deps first", file=sys.stderr)
            return 1
        seen.add(key)
        for text in reqs:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate(dict(env, extra="")):
                todo.append(req.name)
    print(" ".join(sorted(seen)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
