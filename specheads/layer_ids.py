"""The one place that does arithmetic on aux hidden-state layer ids.

specheads, vLLM and speculators number aux layers by the Hugging Face
``output_hidden_states`` index: 0 is the embedding output and i is the input
of decoder layer i (= the output of layer i-1). SpecForge and ModelOpt number
the same tensors by the decoder layer whose *output* they are, i.e. one less.
"""

from __future__ import annotations

from specheads.errors import SpecheadsError


class LayerIdError(SpecheadsError, ValueError):
    """Aux layer ids that do not fit the target (out of range, duplicated, empty)."""


def default_eagle3_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3 default for a target with ``num_layers`` decoder layers, HF index."""
    if num_layers < 4:
        raise LayerIdError(f"EAGLE-3 needs a target with at least 4 decoder layers, got {num_layers}")
    return [2, num_layers // 2, num_layers - 3]


def default_dflash_layer_ids(num_layers: int, count: int = 5) -> list[int]:
    """The published DFlash default, HF index: the outputs of target layers 1 .. L-3 spread evenly over
    ``count`` picks (DFlash numbers a layer by its output, one less than ours); for a 36-layer target
    the outputs 1, 9, 17, 25, 33."""
    if num_layers < 5:
        raise LayerIdError(f"DFlash's default layers need a target with at least 5 decoder layers, got {num_layers}")
    if count == 1:
        return [num_layers // 2 + 1]
    start, span = 1, num_layers - 4
    return [int(round(start + i * span / (count - 1))) + 1 for i in range(count)]


def default_layer_ids(kind: str, num_layers: int) -> list[int]:
    """The aux layers a head of ``kind`` reads by default (EAGLE-3 and P-EAGLE: three; DFlash: five)."""
    return default_dflash_layer_ids(num_layers) if kind == "dflash" else default_eagle3_layer_ids(num_layers)


def hf_to_output_index(ids: list[int]) -> list[int]:
    """HF hidden-state index -> SpecForge/ModelOpt 'output of layer' index."""
    return [int(i) - 1 for i in ids]


def output_to_hf_index(ids: list[int]) -> list[int]:
    """SpecForge/ModelOpt 'output of layer' index -> HF hidden-state index."""
    return [int(i) + 1 for i in ids]


def check_layer_ids(ids: list[int], num_layers: int, *, where: str = "aux_layer_ids") -> list[int]:
    """Valid HF indices are 0..num_layers (num_layers = the final-normed state)."""
    ids = [int(i) for i in ids]
    if not ids:
        raise LayerIdError(f"{where}: at least one layer id is needed")
    bad = [i for i in ids if not 0 <= i <= num_layers]
    if bad:
        raise LayerIdError(
            f"{where}: layer id(s) {bad} out of range for a target with {num_layers} decoder layers "
            f"(valid Hugging Face hidden-state indices are 0..{num_layers})"
        )
    if len(set(ids)) != len(ids):
        raise LayerIdError(f"{where}: duplicate layer ids {ids}")
    return ids


def resolve_aux_layer_ids(requested: list[int] | None, num_layers: int, *, where: str = "head.aux_layer_ids",
                          kind: str = "eagle3") -> list[int]:
    """The aux layer ids a run uses: the recipe's when it names them, else the default of the head ``kind``.

    Every stage (dump, online feed, trainer, export) resolves them here, so the
    manifest, the head config and the export can never disagree.
    """
    ids = list(requested) if requested is not None else default_layer_ids(kind, num_layers)
    return check_layer_ids(ids, num_layers, where=where)
