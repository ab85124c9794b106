"""Running a benchmark against another checkout of the project, side by side with this one."""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path

_ROOMS = ("schemas", "producer", "stream_app")  # the package's folders (pyproject's package-dir)


def env_importing(checkout: Path, root: Path) -> dict[str, str]:
    """An environment whose `import kvledger` loads `checkout`'s package, made under `root`."""
    package = root / "kvledger"
    package.mkdir(parents=True)
    (package / "__init__.py").touch()
    for room in _ROOMS:
        (package / room).symlink_to(checkout.resolve() / room)
    return {**os.environ, "PYTHONPATH": str(root)}  # before the editable install's finder


def has_module(name: str) -> bool:
    """Whether the imported checkout has the module `name` itself: a module it lacks may still be found,
    served from wherever an editable install of the project points."""
    parent, _, _ = name.rpartition(".")
    spec = importlib.util.find_spec(name)
    package = importlib.import_module(parent)
    return spec is not None and spec.origin is not None and Path(spec.origin).parent in map(Path, package.__path__)
