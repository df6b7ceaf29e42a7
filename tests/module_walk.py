"""The walk of a call through t5tpu's modules, traced: which modules it passes through on the
way to the files it reads, and whether it ever turns back into a module it came through.

Every call is seen with the t5tpu modules on its stack (consecutive frames of one module
counted once). Two things are left out of a stack: an import (a module's body runs the code it
imports on a walk of its own), and the helper between a closure and the module that wrote it
(remote.answered runs `lambda: ...` in a thread, jax.jit traces a local function): the closure
is its author's code, so the walk stays in the author's module. What is left is a turn back
when a stack holds a module twice: a module below calling code of one above it (a callback).

Run as a script, it prints both counts of the two walks tests/test_lora.py and
tests/test_serve_adapters.py assert, for a LoRA run's MODEL_DIR (its base as the run names it):
the modules on the way to the files (less PLUMBING) and every t5tpu module entered at all.

    .venv/bin/python tests/module_walk.py /tmp/lora_run
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading

import t5tpu

ROOT = os.path.dirname(t5tpu.__file__)
# The libraries through which t5tpu reads files.
READERS = ("orbax", "etils", "gin", "tensorstore")
# The modules every read in t5tpu goes through, whoever reads: below a walk, not counted in it.
PLUMBING = (
    "storage/user_files.py",
    "storage/remote.py",
    "storage/checkpoint_damage.py",
    "config/gin_setup.py",
)


def _module(code) -> str | None:
    path = code.co_filename
    return os.path.relpath(path, ROOT) if path.startswith(ROOT) else None


def _stack(frame) -> tuple[str, ...]:
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    chain: list[str] = []
    for f in reversed(frames):
        code, module = f.f_code, _module(f.f_code)
        if code.co_name == "<module>":
            chain = []
        elif module is None:
            continue
        elif ("<locals>" in code.co_qualname or code.co_name == "<lambda>") and module in chain:
            del chain[len(chain) - chain[::-1].index(module) :]
        elif not chain or chain[-1] != module:
            chain.append(module)
    return tuple(chain)


def _is_path(value) -> bool:
    return isinstance(value, (str, os.PathLike)) or type(value).__name__.endswith("Path")


def _names_a_path_under(frame, folder: str) -> bool:
    arguments = list(frame.f_locals.values())[:4]
    return any(_is_path(value) and str(value).startswith(folder) for value in arguments)


@dataclasses.dataclass
class Walk:
    """The stacks of every call (`stacks`) and of every call that reads under `folder`
    (`reads`: into orbax, or into etils or gin with a path there)."""

    folder: str
    stacks: set = dataclasses.field(default_factory=set)
    reads: list = dataclasses.field(default_factory=list)

    def __call__(self, frame, event, arg):
        if event != "call":
            return
        caller = frame.f_back
        library = frame.f_globals.get("__name__", "").split(".")[0]
        from_t5tpu = caller is not None and _module(caller.f_code)
        if from_t5tpu and library in READERS and self._reads(library, frame):
            stack = _stack(caller)
            if stack not in self.reads:
                self.reads.append(stack)
        if _module(frame.f_code):
            self.stacks.add(_stack(frame))

    def _reads(self, library: str, frame) -> bool:
        return library == "orbax" or _names_a_path_under(frame, self.folder)

    def modules_to_the_files(self, plumbing: tuple[str, ...]) -> list[str]:
        """The modules the reads pass through, in the order first met, but `plumbing`."""
        found: list[str] = []
        for stack in self.reads:
            found += [m for m in stack if m not in found and m not in plumbing]
        return found

    def entered(self) -> list[str]:
        """Every t5tpu module a call entered, on the way to the files or not."""
        return sorted({module for stack in self.stacks for module in stack})

    def turns_back(self) -> list[tuple[str, ...]]:
        return sorted(stack for stack in self.stacks if len(set(stack)) < len(stack))

    def climbs(self, lower: str, upper: str) -> list[tuple[str, ...]]:
        """The stacks on which a module of folder `upper` ('serve/') is called from one of
        folder `lower` ('model/'): a layer below calling back up into one above."""
        return sorted(
            stack
            for stack in self.stacks
            if any(
                below.startswith(lower) and any(m.startswith(upper) for m in stack[i + 1 :])
                for i, below in enumerate(stack)
            )
        )


def traced(call, folder: str) -> Walk:
    """The walk of `call()`, its reads those of files under `folder`."""
    walk = Walk(folder)
    sys.setprofile(walk)
    threading.setprofile(walk)
    try:
        call()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return walk


def _serve_with_adapter(lora_dir: str) -> None:
    """serve --adapter=a=LORA_DIR over its base: set-up, loading, one score with the adapter."""
    from t5tpu.serve import model_setup

    setup = model_setup.model_setup(
        gin_flags=model_setup.GinFlags(),
        model=None,
        lengths=(None, None),
        truncation=None,
        environ={},
        adapters=(f"a={lora_dir}",),
    )
    worker = model_setup.load_worker(setup, max_batch_size=4, say=lambda line: None)
    worker.adapters.engine_for("a").score([[5, 6, 1]], [[7, 1]])


def _report(name: str, walk: Walk) -> None:
    reads, entered = walk.modules_to_the_files(PLUMBING), walk.entered()
    folders = {module.split("/")[0] for module in entered}
    climbs = walk.climbs("model/", "serve/")
    print(f"{name}: {len(reads)} modules to the files (less plumbing): {', '.join(reads)}")
    print(f"  {len(entered)} modules entered in all, in {len(folders)} folders")
    print(f"  stacks turning back: {len(walk.turns_back())}; model/ -> serve/: {len(climbs)}")


def main(lora_dir: str) -> None:
    import t5tpu as api
    from t5tpu.formats import loader

    base = loader.open_checkpoint(lora_dir).lora.base.path
    folder = os.path.commonpath([os.path.abspath(lora_dir), base])
    for name, call in (
        ("t5tpu.load", lambda: api.load(lora_dir)),
        ("serve --adapter", lambda: _serve_with_adapter(lora_dir)),
    ):
        call()  # imports and first calls outside the walk
        _report(name, traced(call, folder))


if __name__ == "__main__":
    main(sys.argv[1])
