"""The chat page's models: `zerofit generate`'s own generator (`zerofit.trained.generate.load_generator`) for a
run folder, an export folder or a base model as `model.name_or_path` takes it, each loaded once and kept while
the studio runs (the newest few: a 7B model is many GiB)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

from zerofit.core.errors import ConfigError
from zerofit.studio.security import Workspace

KEPT_MODELS = 2  # loaded generators kept (two side by side)


class Chats:
    """Loaded generators by model path, newest kept (see `KEPT_MODELS`); one generation at a time."""

    def __init__(self, workspace: Workspace) -> None:
        self.workspace = workspace
        self._loaded: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def reply(
        self, model: str, prompt: str, max_new_tokens: int = 64, temperature: float = 0.0, image: str = ""
    ) -> str:
        """`model`'s continuation of `prompt` (after `image`, a file in the workspace, for a vision-language
        model), as `zerofit generate MODEL --prompt PROMPT [--image IMAGE]` prints it."""
        from zerofit.commands.generate import check_sampling

        check_sampling(max_new_tokens, temperature)
        if not model.strip():
            raise ConfigError(
                ["model: empty; pick a run, an export folder or a model name (e.g. tiny-llama)"]
            )
        path = self.workspace.model(model)
        picture = self.workspace.path(image, "image") if image.strip() else None
        with self._lock:
            generator = self._generator(path)
            return generator(prompt, max_new_tokens, temperature, 0, picture)

    def _generator(self, path: str) -> Any:
        """The loaded generator of `path` (loaded now if it is not kept)."""
        from zerofit.core.messages import quiet_deepspeed_on_cpu, quiet_libraries
        from zerofit.trained.generate import load_generator

        # A run folder's weights change as it trains on (a resume): its newest write is part of the key.
        key = f"{path}@{Path(path).stat().st_mtime_ns}" if Path(path).exists() else path
        if key in self._loaded:
            self._loaded.move_to_end(key)
            return self._loaded[key]
        quiet_deepspeed_on_cpu()
        quiet_libraries()
        generator = load_generator(Path(path) if Path(path).exists() else path)
        self._loaded[key] = generator
        while len(self._loaded) > KEPT_MODELS:
            self._loaded.popitem(last=False)
        return generator
