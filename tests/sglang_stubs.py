"""Stand-ins for the modules SGLang imports but a CPU-only venv lacks, so that its
disaggregation code (``sglang.srt.disaggregation``) imports and runs on CPU.

Run inside the SGLang venv only (tests/sglang_parity.py). :func:`install` adds two finders:

- the modules of :data:`STUB` (GPU kernels, transports, model-hub and tokenizer packages)
  always become stand-ins, even where installed (none is used by the slicing code);
- any other module that an ``sglang`` module imports and Python cannot find becomes one too
  (the optional imports SGLang makes at start-up); stdlib and private modules never do.

A stand-in module answers every attribute with a stand-in class: callable (a decorator
returns what it decorates), subclassable, indexable, iterable as empty, false. And
``torch.compile`` becomes the identity. :data:`STUBBED` lists the top-level names replaced.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

STUB = frozenset({
    "triton", "sgl_kernel", "flashinfer", "mooncake", "nixl", "nixl_cu12", "nixl_cu13",
    "vllm", "deep_gemm", "deep_ep", "xgrammar", "outlines", "llguidance", "transformers",
    "torchao", "decord", "cuda", "pynvml", "uvloop", "fastapi", "uvicorn", "setproctitle",
    "sentencepiece", "tiktoken", "partial_json_parser", "compressed_tensors", "modelscope",
    "huggingface_hub", "safetensors", "einops", "PIL", "openai", "interegular", "xxhash",
    "blobfile", "hf_transfer", "torchvision", "soundfile", "scipy", "datasets", "IPython",
    "anthropic", "tqdm", "jinja2", "litellm", "cuda_python", "gguf", "timm", "nvtx",
    "kernels", "starlette", "sse_starlette", "watchfiles", "websockets", "quack", "cutlass",
    "tilelang", "apache_tvm_ffi", "tvm_ffi", "cupy", "numba", "pandas",
})
#: Top-level modules replaced so far.
STUBBED: set[str] = set()


class _Meta(type):
    """The type of every stand-in: its classes answer anything."""

    def __new__(mcs, name, bases, ns, **kw):
        return super().__new__(mcs, name, bases, ns)

    def __init__(cls, name, bases, ns, **kw):
        super().__init__(name, bases, ns)

    def __getattr__(cls, name):
        if name == "__class_validators__":
            return []
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _new(f"{cls.__name__}.{name}")

    def __call__(cls, *a, **k):
        if len(a) == 1 and not k and callable(a[0]) and not isinstance(a[0], _Meta):
            return a[0]
        if not a and k:
            return lambda f: f
        return _new(cls.__name__ + "()")

    def __getitem__(cls, k):
        return cls

    def __setitem__(cls, k, v):
        pass

    def __contains__(cls, k):
        return False

    def __len__(cls):
        return 0

    def __iter__(cls):
        return iter(())

    def __bool__(cls):
        return False

    def __int__(cls):
        return 0

    def __index__(cls):
        return 0

    def __float__(cls):
        return 0.0

    def __eq__(cls, o):
        return cls is o

    def __hash__(cls):
        return id(cls)

    def __lt__(cls, o):
        return False

    __gt__ = __le__ = __ge__ = __lt__

    def __or__(cls, o):
        return cls

    __ror__ = __add__ = __radd__ = __mul__ = __rmul__ = __or__


def _new(name: str) -> type:
    return _Meta(name, (), {"__init_subclass__": classmethod(lambda c, **k: None)})


class StubModule(types.ModuleType):
    """A stand-in module: any attribute is a stand-in class."""

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        v = _new(f"{self.__name__}.{name}")
        setattr(self, name, v)
        return v


class _Loader(importlib.abc.Loader):
    def create_module(self, spec):
        m = StubModule(spec.name)
        m.__path__ = []
        m.__file__ = "<stub>"
        return m

    def exec_module(self, module):
        pass


def _from_sglang() -> bool:
    """Whether the import being resolved comes from an ``sglang`` module."""
    f = sys._getframe(2)
    while f is not None:
        mod = f.f_globals.get("__name__", "")
        if not (mod.startswith(("importlib", "_frozen")) or mod == __name__):
            return mod.startswith("sglang")
        f = f.f_back
    return False


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, anything: bool = False):
        self.anything = anything

    def find_spec(self, name, path, target=None):
        top = name.split(".")[0]
        if self.anything:
            if (top == "sglang" or top in sys.stdlib_module_names or top.startswith("_")
                    or not _from_sglang()):
                return None
        elif top not in STUB:
            return None
        STUBBED.add(top)
        return importlib.machinery.ModuleSpec(name, _Loader(), is_package=True)


def install() -> None:
    """Put the finders in place and make ``torch.compile`` the identity."""
    sys.meta_path.insert(0, _Finder())
    sys.meta_path.append(_Finder(anything=True))
    import torch

    torch.compile = lambda *a, **k: a[0] if a and callable(a[0]) else (lambda f: f)
