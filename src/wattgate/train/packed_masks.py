"""Packed documents kept apart for a model whose decoder builds its attention masks without position_ids.

With eager or sdpa attention, transformers' masking_utils keeps each packed document to itself only when the
decoder passes position_ids to `create_causal_mask` (document ids from where they restart; train/attention.py).
transformers 5.24's GptOssModel does not (its mask_kwargs are config, inputs_embeds, attention_mask and cache):
packed documents attend to each other, a silently different objective (measured on a 2-layer GPT-OSS: logits
of the second and third of three packed documents off by up to 0.23 against each scored alone, the first equal).

Such a decoder accepts the masks prepared (`isinstance(attention_mask, dict)`: what generate passes), so a forward
pre-hook builds them here with masking_utils' own functions, one per layer type, from the same position_ids, and
hands them in: the masks the decoder would build if it passed position_ids. Flash kernels get explicit document
boundaries instead (cu_seq_lens) and need nothing. A decoder that ignores position_ids and takes no prepared
masks is left as it is (none of the tested architectures).
"""

from __future__ import annotations

import ast
import inspect
import textwrap


MASK_FUNCTIONS = {
    "full_attention": "create_causal_mask",
    "sliding_attention": "create_sliding_window_causal_mask",
    "chunked_attention": "create_chunked_causal_mask",
}
HOOKED = "wattgate_packed_masks"


def _mask_calls(tree) -> tuple[list[ast.Call], dict[str, ast.Dict]]:
    calls = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and ast.unparse(n.func).split(".")[-1] in MASK_FUNCTIONS.values()
    ]
    dicts = {
        n.targets[0].id: n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Assign)
        and len(n.targets) == 1
        and isinstance(n.targets[0], ast.Name)
        and isinstance(n.value, ast.Dict)
    }
    return calls, dicts


def _takes_prepared_masks(tree) -> bool:
    """The forward checks `isinstance(<...attention_mask>, dict)`: it uses a mapping of prepared masks as given."""
    return any(
        isinstance(n, ast.Call)
        and ast.unparse(n.func) == "isinstance"
        and len(n.args) == 2
        and ast.unparse(n.args[1]) == "dict"
        and "attention_mask" in ast.unparse(n.args[0])
        for n in ast.walk(tree)
    )


def masks_ignore_position_ids(decoder) -> bool:
    """True when `decoder`'s forward builds its masks with masking_utils, never passes them position_ids, and
    accepts them prepared (a dict attention_mask); read from the forward's source, the same on every rank."""
    try:
        source = textwrap.dedent(inspect.getsource(inspect.unwrap(type(decoder).forward)))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError):
        return False
    calls, dicts = _mask_calls(tree)
    if not calls or not _takes_prepared_masks(tree):
        return False
    for call in calls:
        if any(k.arg == "position_ids" for k in call.keywords):
            return False
        for k in call.keywords:
            if (  # a dict spread into the call (**name) that holds position_ids
                k.arg is None
                and isinstance(k.value, ast.Name)
                and k.value.id in dicts
                and any(isinstance(key, ast.Constant) and key.value == "position_ids" for key in dicts[k.value.id].keys)
            ):
                return False
    return True


def install_packed_masks(model) -> bool:
    """Hook `model`'s decoder when its masks would let packed documents see each other (masks_ignore_position_ids)
    and its attention takes a mask (not a flash kernel); True when hooked. Idempotent."""
    from wattgate.train.attention import FLASH_VARLEN

    decoder = model.get_decoder()
    if decoder.__dict__.get(HOOKED):
        return True
    kinds = set(getattr(decoder.config, "layer_types", None) or ["full_attention"])
    if model.config._attn_implementation in FLASH_VARLEN or not kinds <= MASK_FUNCTIONS.keys():
        return False
    if not masks_ignore_position_ids(decoder):
        return False
    decoder.register_forward_pre_hook(_prepared_masks, with_kwargs=True)
    object.__setattr__(decoder, HOOKED, True)
    return True


def _prepared_masks(decoder, args, kwargs):
    """Forward pre-hook: the masks for each of the config's layer types from position_ids, as masking_utils builds
    them when it is given position_ids (a caller's own attention_mask is left alone)."""
    import transformers.masking_utils as masking

    position_ids = kwargs.get("position_ids")
    if kwargs.get("attention_mask") is not None or position_ids is None:
        return None
    ids = kwargs.get("input_ids", args[0] if args else None)
    embeds = kwargs.get("inputs_embeds")
    weight = decoder.get_input_embeddings().weight  # unsharded here: the compute dtype and device
    shape = tuple(embeds.shape[:2]) if embeds is not None else tuple(ids.shape)
    like = weight.new_empty((*shape, 1))  # masking_utils reads its batch, length, dtype and device only
    config = decoder.config
    kinds = sorted(set(getattr(config, "layer_types", None) or ["full_attention"]))
    kwargs["attention_mask"] = {
        kind: getattr(masking, MASK_FUNCTIONS[kind])(
            config=config, inputs_embeds=like, attention_mask=None, cache=None, position_ids=position_ids
        )
        for kind in kinds
    }
    return args, kwargs
