"""Which LoRA adapter a peft model runs, changed only when a forward needs another.

peft's ``set_adapter``, and its ``disable_adapter`` context (which re-enables on exit), walk every
loaded adapter of every LoRA layer to set ``requires_grad``: on SmolLM2-135M about 4.5 ms per
adapter loaded. The transformers engine's batchers choose the adapter before each forward, that
is once per decoded token, so an engine serving many versions (online learning, many models on
one base) decoded several times slower per version loaded (64 adapters: a base-model forward
9x, an adapter's 3x). :class:`AdapterSwitch` remembers what the model was set to and calls peft
only on a change; the engine makes it forget whenever it loads or deletes an adapter.
"""

from __future__ import annotations

from typing import Any

_UNKNOWN = object()  # after a load or delete: set everything again before the next forward
_ENABLED = object()  # adapter layers on, the active adapter not known (after a mixed batch)


class AdapterSwitch:
    """The adapter state of one engine's model: ``None`` while adapter layers are off (the base
    model), an adapter's name while it is the active one."""

    def __init__(self) -> None:
        self._state: object = _UNKNOWN

    def forget(self) -> None:
        """The model's adapters changed (loaded, deleted, the model replaced): the next
        :meth:`select` sets its state in full."""
        self._state = _UNKNOWN

    def select(self, model: Any, adapters: list[str | None]) -> dict[str, Any]:
        """Set ``model`` up for a forward whose rows use these adapters (None: the base model)
        and return the forward's extra arguments: for rows of several adapters peft routes each
        row (``adapter_names``), with the adapter layers on."""
        if not hasattr(model, "peft_config"):
            return {}
        if len(set(adapters)) > 1:
            self._enable(model)
            return {"adapter_names": [a or "__base__" for a in adapters]}
        wanted = adapters[0]
        if wanted is None:
            if self._state is not None:
                model.base_model.disable_adapter_layers()
                self._state = None
        elif self._state != wanted:
            self._enable(model)
            model.set_adapter(wanted)
            self._state = wanted
        return {}

    def _enable(self, model: Any) -> None:
        if self._state is None or self._state is _UNKNOWN:
            model.base_model.enable_adapter_layers()
            self._state = _ENABLED
