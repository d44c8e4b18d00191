"""The reference's released weights: reading its files, and its parameter names mapped to ours both ways.

The reference (CLIP4IDC, CLIP for Image Difference Captioning: github.com/sushizixin/CLIP4IDC at commit ca49461)
publishes the model after each stage (its README.md): pretrained/pytorch_model.bin.{clevr,spot} after adaptation
(stage 1) and trained/pytorch_model.bin.{clevr,spot} after captioning (stage 2). Each is what its scripts save,
torch.save(model.state_dict()): one flat dict of tensors, the CLIP4IDC model's clip.* (CLIP under OpenAI's names,
the pair parameters under clip.visual.*, many of CLIP's weights float16 as its modules/module_clip.py
`convert_weights` left them) and, after captioning, decoder.* (the caption decoder, float32, under the names of
BERT, Bidirectional Encoder Representations from Transformers).

This file is the one place that knows those names; it is plumbing, off the reading path (the lesson's files
never need it). It holds, top to bottom:
  1. the pair encoder's names (encoder.py's four new parameters) to ours and back;
  2. the caption decoder's names (decoder.py) to ours and back, and the check of the tied copies;
  3. which stage a file is, and reading one as data (weights_only), never as code;
  4. the pair encoder of a release, sized from its tensors and loaded with strict=True; its decoder's sizes
     (caption.py's release_decoder builds and loads it: nothing here imports decoder.py).

Use (checkpoints.read_encoder, caption.py):
    stage, state = read_release("trained/pytorch_model.bin.clevr")
    pair_encoder = encoder.from_checkpoint(release_checkpoint(state))   # either stage: its clip.*
    decoder = caption.release_decoder(state, 2 * (pair_encoder.n_patches + 1))   # stage 2: its decoder.*

Run the commands on a release: README.md, "Using the released weights"; what was checked against the
reference's own code: BENCHMARKS.md section 12.
"""
import dataclasses
from pathlib import Path

import torch

import clip
from plumbing import clip_files

# ---------------------------------------------------------------------------------------------------
# 1. The pair encoder's names

# The reference's checkpoint names of the new parameters, and ours.
REFERENCE_NAMES = {
    "clip.visual.bef_embedding": "before_embedding",
    "clip.visual.aft_embedding": "after_embedding",
    "clip.visual.joint_positional_embedding": "joint_positional_embedding",
    "clip.visual.ln_mid.weight": "ln_mid.weight",
    "clip.visual.ln_mid.bias": "ln_mid.bias",
}


def rename_reference_keys(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A reference CLIP4IDC checkpoint (pytorch_model.bin.*) as a PairEncoder state dict, in float32.

    Its clip.* keys are CLIP's and keep their names, except the four new parameters (REFERENCE_NAMES).
    Keys outside clip.* (the reference's caption decoder) are left out; load the result with
    strict=True so that anything missing fails loudly.
    """
    return {REFERENCE_NAMES.get(key, key): value.float() if value.is_floating_point() else value
            for key, value in state_dict.items() if key.startswith("clip.")}


def to_reference_keys(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A PairEncoder state dict under the reference's names: rename_reference_keys the other way (no cast)."""
    ours_to_reference = {ours: reference for reference, ours in REFERENCE_NAMES.items()}
    return {ours_to_reference.get(key, key): value for key, value in state_dict.items()}


# ---------------------------------------------------------------------------------------------------
# 2. The caption decoder's names
#
# The reference saves its whole caption model; the decoder's tensors sit under "decoder." with the names of
# its modules/module_decoder.py: BERT-style layers ("encoder" = our visual layers, "decoder" = our caption
# layers), each attention an "att" (query, key, value) and an "output" (dense, LayerNorm). Its word embedding
# is one Parameter saved under three keys (CLIP's token_embedding, the decoder's input embedding and the
# output weight), its position embedding under two (CLIP's and the decoder's): ours has each once.

REFERENCE_OUTPUT_WEIGHT = "decoder.classifier.cls.predictions.decoder.weight"  # the tied output weight
REFERENCE_TIES = {"decoder.embeddings.word_embeddings.weight": ("clip.token_embedding.weight", REFERENCE_OUTPUT_WEIGHT),
                  "decoder.embeddings.position_embeddings.weight": ("clip.positional_embedding",)}
REFERENCE_ATTENTION = {"query": "att.query", "key": "att.key", "value": "att.value",
                       "out": "output.dense", "norm": "output.LayerNorm"}
REFERENCE_FEED_FORWARD = {"up": "intermediate.dense", "down": "output.dense", "norm": "output.LayerNorm"}


def reference_names(layers: int) -> dict[str, str]:
    """Our CaptionDecoder's state-dict names -> the reference's keys, for a decoder of `layers` layers."""
    names = {"word_embedding": "decoder.embeddings.word_embeddings.weight",
             "position_embedding": "decoder.embeddings.position_embeddings.weight",
             "output_bias": "decoder.classifier.cls.predictions.bias"}
    modules = {"embedding_norm": "decoder.embeddings.LayerNorm",
               "head_dense": "decoder.classifier.cls.predictions.transform.dense",
               "head_norm": "decoder.classifier.cls.predictions.transform.LayerNorm"}
    stacks = {"visual_layers": ("decoder.encoder", {"self_attention": "slf_attn"}),
              "caption_layers": ("decoder.decoder", {"self_attention": "slf_attn", "cross_attention": "enc_attn"})}
    for ours, (theirs, attentions) in stacks.items():
        for i in range(layers):
            for our_attention, their_attention in attentions.items():
                modules.update({f"{ours}.{i}.{our_attention}.{part}": f"{theirs}.layer.{i}.{their_attention}.{name}"
                                for part, name in REFERENCE_ATTENTION.items()})
            modules.update({f"{ours}.{i}.feed_forward.{part}": f"{theirs}.layer.{i}.{name}"
                            for part, name in REFERENCE_FEED_FORWARD.items()})
    for ours, theirs in modules.items():  # each a Linear or a LayerNorm: weight and bias
        names.update({f"{ours}.{p}": f"{theirs}.{p}" for p in ("weight", "bias")})
    return names


def reference_layers(state_dict: dict[str, torch.Tensor]) -> int:
    """How many layers the reference's decoder.* keys hold (as many visual layers as caption layers)."""
    counts = [len({key.split(".")[3] for key in state_dict if key.startswith(f"decoder.{stack}.layer.")})
              for stack in ("encoder", "decoder")]
    if counts[0] != counts[1]:
        raise ValueError(f"the reference's decoder has {counts[0]} visual and {counts[1]} caption layers; "
                         "its model pairs them one to one, so a file with different counts is damaged")
    return counts[0]


def rename_reference_decoder_keys(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The decoder.* tensors of a reference captioning model as a CaptionDecoder state dict, in float32.

    The tied copies are checked equal (they are one Parameter in the reference) and read once; a missing key
    or a decoder.* key that has no place here raises ValueError, so nothing is dropped or left random.
    """
    names = reference_names(reference_layers(state_dict))
    for key, copies in REFERENCE_TIES.items():
        for copy in copies:
            if copy in state_dict and key in state_dict and not torch.equal(state_dict[copy].float(),
                                                                             state_dict[key].float()):
                raise ValueError(f"{copy} differs from {key}: the reference ties them, so the file is damaged")
    theirs = {key for key in state_dict if key.startswith("decoder.")} - {REFERENCE_OUTPUT_WEIGHT}
    missing, unexpected = sorted(set(names.values()) - theirs), sorted(theirs - set(names.values()))
    if missing or unexpected:
        raise ValueError(f"the reference's decoder keys do not fit CLIP4IDC's caption decoder: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]} ({len(missing)} and {len(unexpected)} in all)")
    return {ours: state_dict[key].float() for ours, key in names.items()}


def to_reference_decoder_keys(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A CaptionDecoder state dict under the reference's decoder.* names, the output weight included (no cast)."""
    names = reference_names(len({key.split(".")[1] for key in state_dict if key.startswith("caption_layers.")}))
    theirs = {names[key]: value for key, value in state_dict.items()}
    theirs[REFERENCE_OUTPUT_WEIGHT] = state_dict["word_embedding"]
    return theirs


# ---------------------------------------------------------------------------------------------------
# 3. Which stage a file is, read as data

RELEASE = ("a CLIP4IDC release file, the reference's torch.save(model.state_dict()) (pytorch_model.bin.*): "
           "tensors under clip.*, and decoder.* after the captioning stage")


def release_stage(state) -> int | None:
    """1 for a release of the adaptation stage (clip.* only), 2 for one of the captioning stage (clip.* and
    decoder.*), None for anything else (this project's checkpoints are dicts with a "model" entry)."""
    if not isinstance(state, dict) or not all(isinstance(value, torch.Tensor) for value in state.values()):
        return None
    if not all(isinstance(key, str) and key.startswith(("clip.", "decoder.")) for key in state):
        return None
    if "clip.visual.joint_positional_embedding" not in state:  # CLIP4IDC's pair parameters, not a plain CLIP
        return None
    return 2 if any(key.startswith("decoder.") for key in state) else 1


def read_release(path) -> tuple[int, dict[str, torch.Tensor]]:
    """(stage, state dict) of a reference release file, read as data (weights_only), never run as code.

    Raises clip_files.FileError, one line saying what was expected, for a file of any other kind.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no file at {path}: pass the path of a release file such as "
                                "trained/pytorch_model.bin.clevr")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # not a torch file, or one holding more than tensors and containers
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:160]
        raise clip_files.FileError(f"{path} is not {RELEASE}; torch.load read no state dict from it "
                                   f"({reason})") from None
    stage = release_stage(state)
    if stage is None:
        raise clip_files.FileError(f"{path} is not {RELEASE}")
    return stage, state


# ---------------------------------------------------------------------------------------------------
# 4. The pair encoder of a release, and its decoder's sizes


def release_checkpoint(state_dict: dict[str, torch.Tensor], intra_layers: int = 9) -> dict:
    """A release (either stage) as the checkpoint of the pair encoder it holds, which encoder.from_checkpoint
    rebuilds: its clip.* in our names ("model"), CLIP's sizes read off the tensors ("clip_config", clip.config_of),
    and the split point ("encoder_config"), which the file does not hold: the reference's is
    --intra_num_hidden_layers, 9 by default and in all its scripts."""
    ours = rename_reference_keys(state_dict)  # float32: CLIP's float16 weights widen exactly
    clip_state = {key.removeprefix("clip."): value for key, value in ours.items() if key.startswith("clip.")}
    return {"model": ours, "clip_config": dataclasses.asdict(clip.config_of(clip_state)),
            "encoder_config": {"intra_layers": intra_layers}}


def release_decoder_sizes(state_dict: dict[str, torch.Tensor]) -> dict[str, int]:
    """The reference's decoder sizes, read off its tensors, as decoder.DecoderConfig's fields (caption.py builds it:
    its release_decoder)."""
    words = state_dict["decoder.embeddings.word_embeddings.weight"]  # (V, E)
    hidden = words.shape[1]
    # Heads are not in the tensors: the reference's decoder-base config has 8 heads of 64 channels at width
    # 512, CLIP's head width too (clip.build_model reads CLIP's heads the same way).
    return dict(hidden=hidden, heads=max(1, hidden // 64),
                ffn=state_dict["decoder.decoder.layer.0.intermediate.dense.weight"].shape[0],
                layers=reference_layers(state_dict), vocab_size=words.shape[0],
                max_positions=state_dict["decoder.embeddings.position_embeddings.weight"].shape[0])
