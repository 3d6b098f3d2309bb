"""Image rows encoded for training: token ids with each image's placeholder expanded exactly as
the model's processor expands it, labels on what is learned, and the images as references with
their pixel buckets (pixel values are made later, when a block is read: `Processing.pixels`).

The processing of a model folder (`Processing.load`): its AutoProcessor (LLaVA, Gemma 3), or,
where the processor class cannot be built (Qwen2.5-VL's needs torchvision for its video
processor, which has no CPU build for torch 2.13 here), its tokenizer and image processor with
the processor's rule written out ("<|image_pad|>" x grid_t * grid_h * grid_w / merge^2).

A row is rendered by the chat template (the processor's, set on the tokenizer) with one
placeholder per image, and what is learned is found on that rendering by data/chat.py's
ChatTemplate: the assistant turns ({% generation %} tags, or the untagged rule), or the
completion of prompt-completion rows. Each placeholder is then replaced by its expansion (the
processor's replace_image_token for the image's bucket: LLaVA's "<image>" x tokens, Gemma 3's
"\\n\\n<start_of_image>" + image tokens + "<end_of_image>\\n\\n"), and the expanded text is
tokenized: the ids the processor gives for the same text and images. A token is learned when a
character of it came from a learned one of the rendering; the characters the expansion inserted,
and image tokens, never are; nor is an example's first token (data/sft.py's rule).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ....errors import InputError
from ....data.chat import ChatTemplate
from ....data.sft import IGNORE_INDEX, SFTStats
from .buckets import Buckets, make_buckets
from .rows import ImageRef, conversation, image_ref, image_size, open_image


@dataclass
class ImageExample:
    """One encoded row."""

    input_ids: np.ndarray
    """int32 token ids, image tokens expanded."""
    labels: np.ndarray
    """int32: the token where it is learned, else -100 (unshifted, as Hugging Face models take)."""
    images: list[ImageRef]
    """The row's images in order (absolute paths or bytes: rows.open_image)."""
    buckets: list[int]
    """Each image's pixel bucket (an index into Processing.buckets.sizes)."""
    images_end: int = 0
    """The token just past the last image's expansion (0 without images): a block must hold at
    least this much of the example."""
    where: str = ""
    """The row, as errors name it ("--dataset FILE line N")."""
    distortion: float = 0.0
    """The most one of its images' aspect ratio changes in its bucket (Buckets.distortion)."""


@dataclass
class ImageStats(SFTStats):
    """What became of a data set's image rows (SFTStats' counts and the images)."""

    images: int = 0
    """Images in the examples kept."""
    bad_rows: int = 0
    """Rows left out (--skip-bad-rows) because an image of theirs cannot be read."""
    bad_reason: str = ""
    """The first such row's line (what ends the run without --skip-bad-rows)."""

    def add(self, other: ImageStats) -> ImageStats:
        """These counts and `other`'s (another split's), the first bad row's reason kept."""
        return ImageStats(self.rows + other.rows, self.examples + other.examples,
                          self.nothing_to_learn + other.nothing_to_learn, self.images + other.images,
                          self.bad_rows + other.bad_rows, self.bad_reason or other.bad_reason)


@dataclass
class Processing:
    """How a model folder turns images and text into its inputs."""

    tokenizer: object
    """The fast tokenizer, with the processor's chat template set."""
    image_processor: object
    config: object
    """The model's config (transformers)."""
    family: object
    """models.vision.VisionFamily."""
    buckets: Buckets
    placeholder: str
    """What the chat template writes for an image and the processor expands: "<image>",
    "<start_of_image>", "<|image_pad|>"."""
    image_token_id: int
    """The token the image features replace."""
    processor: object | None = None
    """The folder's processor object, None where it cannot be built (Qwen2.5-VL here)."""
    expansions: list[str] = field(default_factory=list)
    """What one image's placeholder becomes, per bucket."""
    chat: ChatTemplate | None = None
    _blank: dict = field(default_factory=dict, repr=False)

    @classmethod
    def load(cls, folder: str | Path, config=None, image_buckets: list[str] | None = None) -> Processing:
        """The processing of the model folder `folder` (config read from it unless given), its
        buckets from --image-buckets."""
        import transformers

        from ..family import image_token_id, refusal, vision_family

        config = config or transformers.AutoConfig.from_pretrained(folder)
        family = vision_family(config)
        if family is None:
            raise InputError(refusal(config.model_type) or f"{folder} is not an image-text-to-text model")
        processor = _processor(folder)
        if processor is not None:
            tokenizer, images = processor.tokenizer, processor.image_processor
            template = getattr(processor, "chat_template", None)
        else:
            tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
            images = transformers.AutoImageProcessor.from_pretrained(folder)
            template = None
        if template:
            tokenizer.chat_template = template
        token_id = image_token_id(config)
        placeholder = getattr(processor, "image_token", None) or tokenizer.convert_ids_to_tokens(token_id)
        made = cls(tokenizer, images, config, family, None, placeholder, token_id, processor)
        made.buckets = make_buckets(family, images, image_buckets, made._tokens_of)
        made.expansions = [made._expansion(size) for size in made.buckets.sizes]
        if made.buckets.tokens == 0:
            raise InputError(f"the processor of {folder} expands an image's {placeholder!r} into no "
                             f"image token (id {token_id}, the model's config's): the folder's "
                             "tokenizer or processor does not belong to its model")
        return made

    # -- the images' tokens -------------------------------------------------------------------

    def _processed(self, width: int, height: int) -> dict:
        """The image processor's output for a blank image of that size."""
        from PIL import Image

        return self.image_processor(images=[Image.new("RGB", (width, height))], return_tensors="np")

    def _expansion(self, size: tuple[int, int]) -> str:
        """What the processor writes for one image's placeholder in a bucket of `size`."""
        if self.processor is not None:
            return self.processor.replace_image_token(self._processed(*size), image_idx=0)
        grid = self._processed(*size)["image_grid_thw"][0]
        merge = int(getattr(self.image_processor, "merge_size", 1) or 1)
        return self.placeholder * (int(np.prod(grid)) // merge ** 2)

    def _tokens_of(self, width: int, height: int) -> int:
        ids = self.tokenizer(self._expansion((width, height)), add_special_tokens=False)["input_ids"]
        return sum(1 for t in ids if t == self.image_token_id)

    # -- pixel values (read when a block is made) ---------------------------------------------

    def pixels(self, ref: ImageRef, bucket: int, where: str | None = None) -> dict:
        """The pixel values of one image in its bucket: {"pixel_values": [C, H, W] float32}, or
        (Qwen) {"pixel_values": [P, C*T*p*p] float32, "image_grid_thw": [3] int64}: the image
        processor's output for the image resized to the bucket."""
        image = self.buckets.resize(open_image(ref, where), bucket)
        return self._tensors(self.image_processor(images=[image], return_tensors="np"), bucket)

    def blank(self, bucket: int = 0) -> dict:
        """`pixels` of a blank (black) image of the bucket: what a padding image slot holds."""
        if bucket not in self._blank:
            self._blank[bucket] = self._tensors(self._processed(*self.buckets.sizes[bucket]), bucket)
        return {key: value.clone() for key, value in self._blank[bucket].items()}

    def _tensors(self, out, bucket: int) -> dict:
        import torch

        values = torch.from_numpy(np.ascontiguousarray(out["pixel_values"], dtype=np.float32))
        if "image_grid_thw" in out:
            return {"pixel_values": values,
                    "image_grid_thw": torch.as_tensor(np.asarray(out["image_grid_thw"][0]), dtype=torch.int64)}
        width, height = self.buckets.sizes[bucket]
        if values.shape[0] != 1 or values.shape[-2:] != (height, width):
            raise InputError(f"the image processor made pixel values of shape {tuple(values.shape)} "
                             f"of one image, not one {width}x{height} image: its settings (pan and "
                             "scan, tiling) make several images of one, which is not covered")
        return {"pixel_values": values[0]}

    def template(self) -> ChatTemplate:
        """The chat template (the processor's, on the tokenizer), made once."""
        if self.chat is None:
            if not getattr(self.tokenizer, "chat_template", None):
                raise InputError(f"the model folder {getattr(self.tokenizer, 'name_or_path', '')} has "
                                 "no chat template (neither its processor nor its tokenizer), which "
                                 "image rows need: pass --chat-template FILE")
            self.chat = ChatTemplate(self.tokenizer)
        return self.chat


def _processor(folder):
    """The folder's processor object, or None where it has none or it cannot be built (an
    ImportError: Qwen2.5-VL's video processor needs torchvision)."""
    import transformers
    from transformers.processing_utils import ProcessorMixin

    try:
        processor = transformers.AutoProcessor.from_pretrained(folder)
    except (ImportError, OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # (AttributeError: transformers' video-processor mapping without torchvision)
    return processor if isinstance(processor, ProcessorMixin) else None


# -- rows to examples ------------------------------------------------------------------------------

def encode_row(row, fmt: str, processing: Processing, where: str, folder: Path | None = None, *,
               assistant_only_loss: bool = True, completion_only_loss: bool = True) -> ImageExample | None:
    """One row of image format `fmt` (rows.FORMATS) as an ImageExample; None when nothing of it is
    learned. Image paths are relative to `folder` (the data file's). Each problem is one line
    naming the row (`where`)."""
    messages, completion, values = conversation(row, fmt, where)
    refs = readable_images(values, folder, where)
    sizes = [image_size(ref, where) for ref in refs]
    buckets = choose_buckets(refs, processing, where, sizes)
    chat = processing.template()
    prompt_completion = len(completion) < len(messages)
    only = completion_only_loss if prompt_completion else assistant_only_loss
    text = chat.render(messages, False, where)
    if only:
        ids, mask = chat.assistant_mask(messages, completion, where)
    else:
        ids, _ = chat.tokenize(text)
        mask = [True] * len(ids)
    learned = np.zeros(len(text), dtype=bool)  # per character of the rendering
    for (start, end), on in zip(chat.tokenize(text)[1], mask):
        learned[start:end] |= on
    input_ids, offsets, origin = expanded_tokens(text, processing, buckets, where)
    # A token is learned when one of its characters came from a learned one of the rendering.
    from_learned = np.concatenate([[0], np.cumsum(np.where(origin >= 0, learned[origin], False))])
    on = (from_learned[offsets[:, 1]] > from_learned[offsets[:, 0]]) \
        & (input_ids != processing.image_token_id) & (np.arange(len(input_ids)) > 0)
    labels = np.where(on, input_ids, IGNORE_INDEX).astype(np.int32)
    if not (labels != IGNORE_INDEX).any():
        return None
    image_at = np.flatnonzero(input_ids == processing.image_token_id)
    end = _images_end(offsets, origin, image_at)
    distortion = max((processing.buckets.distortion(*size, b) for size, b in zip(sizes, buckets)), default=0.0)
    return ImageExample(input_ids, labels, refs, buckets, end, where, distortion)


class UnreadableImage(InputError):
    """A row's image is missing or cannot be decoded (one line naming the row and the image):
    what --skip-bad-rows skips."""


SKIP_HINT = "fix or remove the row, or pass --skip-bad-rows to leave out the rows whose image cannot be read"
"""What the line of an unreadable image says to do."""


def readable_images(values: list, folder: Path | None, where: str) -> list[ImageRef]:
    """The references of a row's images (rows.image_ref), each decoded whole now (rows.open_image),
    so that a missing file or a truncated body is met while the data set is encoded, named by
    its row, and never at step N of the run, when a block is made (UnreadableImage)."""
    refs = []
    try:
        for value in values:
            refs.append(image_ref(value, folder, where))
            open_image(refs[-1], where)
    except InputError as error:
        raise UnreadableImage(str(error)) from None
    return refs


def encode_prompt(messages: list[dict], refs: list[ImageRef], processing: Processing,
                  where: str) -> tuple[np.ndarray, list[int]]:
    """(int32 token ids, each image's bucket) of a conversation rendered with the generation
    prompt, as a question to the model (`hputrain generate`): `messages` as rows.as_parts makes
    them, each image's placeholder expanded for its bucket exactly as a training row's is, so
    that a question is encoded as the model was trained."""
    buckets = choose_buckets(refs, processing, where)
    text = processing.template().render(messages, True, where)
    return expanded_tokens(text, processing, buckets, where)[0], buckets


def choose_buckets(refs: list[ImageRef], processing: Processing, where: str,
                   sizes: list[tuple[int, int]] | None = None) -> list[int]:
    """Each image's pixel bucket: the one nearest its shape as shown (rows.image_size, unless
    `sizes` gives them)."""
    sizes = sizes if sizes is not None else [image_size(ref, where) for ref in refs]
    return [processing.buckets.choose(*size) for size in sizes]


def expanded_tokens(text: str, processing: Processing, buckets: list[int],
                    where: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(int32 token ids, their character offsets [N, 2], per character the one of `text` it came
    from or -1) of rendered `text` with each image placeholder expanded for its bucket; an image
    token in a message's own text is one line."""
    expanded, origin = _expand(text, processing, buckets, where)
    encoded = processing.tokenizer(expanded, add_special_tokens=False, return_offsets_mapping=True)
    input_ids = np.asarray(encoded["input_ids"], dtype=np.int32)
    offsets = np.asarray(encoded["offset_mapping"], dtype=np.int64).reshape(-1, 2)
    found = int((input_ids == processing.image_token_id).sum())
    expected = sum(processing.buckets.counts[b] for b in buckets)
    if found != expected:
        raise InputError(f"{where}: the expanded conversation holds {found} image tokens, not the "
                         f"{expected} of its {len(buckets)} image(s): a message's text holds the "
                         "model's image token")
    return input_ids, offsets, origin


def _expand(text: str, processing: Processing, buckets: list[int], where: str) -> tuple[str, np.ndarray]:
    """(the text with each image placeholder replaced by its bucket's expansion, for each of its
    characters the index of the character of `text` it came from, -1 where inserted)."""
    found = [m.span() for m in re.finditer(re.escape(processing.placeholder), text)]
    if len(found) != len(buckets):
        raise InputError(f"{where}: the rendered conversation holds {len(found)} image "
                         f"placeholder(s) {processing.placeholder!r} for {len(buckets)} image(s): a "
                         f"message's text holds {processing.placeholder!r}, or the chat template "
                         "writes it outside image parts")
    pieces, origin, last = [], [], 0
    for (start, end), bucket in zip(found, buckets):
        pieces += [text[last:start], processing.expansions[bucket]]
        origin += [np.arange(last, start), np.full(len(processing.expansions[bucket]), -1)]
        last = end
    pieces.append(text[last:])
    origin.append(np.arange(last, len(text)))
    return "".join(pieces), np.concatenate(origin).astype(np.int64)


def _images_end(offsets, origin: np.ndarray, image_at: np.ndarray) -> int:
    """The token just past the last image's expansion: after its last image token, on through
    the tokens whose characters the expansion inserted (Gemma 3's <end_of_image>)."""
    if not len(image_at):
        return 0
    end = int(image_at[-1]) + 1
    while end < len(offsets) and offsets[end][1] > offsets[end][0] \
            and (origin[offsets[end][0]:offsets[end][1]] < 0).all():
        end += 1
    return end


def check_fits(example: ImageExample, block_size: int, where: str | None = None) -> None:
    """One line when the example's images do not fit whole into a block of `block_size` tokens
    (text after the last image may be cut: the packing counts that)."""
    if example.images_end <= block_size:
        return
    where = where or example.where or "a row"
    raise InputError(f"{where}: the conversation is {len(example.input_ids)} tokens with its "
                     f"{len(example.images)} image(s) counted, and its last image ends at token "
                     f"{example.images_end}, past --block-size {block_size}: give --block-size "
                     f"{example.images_end} or more (or smaller --image-buckets, where the model "
                     "takes several)")


# -- a split ---------------------------------------------------------------------------------------

ROWS_PER_PART = 64
"""Rows an encoding process takes at a time."""


def encode_split(rows, fmt: str, processing: Processing, options,
                 workers: int = 1) -> tuple[list[ImageExample], ImageStats]:
    """Every row of a split encoded, in `workers` processes, in row order. `rows`: (where, row,
    folder) triples: where names the row in errors (hf_data.records' "FILE line N", prefixed
    here with "--dataset "), folder is the one its image paths are relative to (the row's data
    file's folder; a save_to_disk folder). `options`: assistant_only_loss and
    completion_only_loss (HFOptions), and skip_bad_rows. Rows with nothing to learn are counted
    and left out; so are rows with an image that cannot be read, under skip_bad_rows (else the
    first is one line naming it, before the run's first step)."""
    from ....data.token_store import chunks, ordered_map

    context = (fmt, processing, options.assistant_only_loss, options.completion_only_loss,
               bool(getattr(options, "skip_bad_rows", False)))
    examples, stats = [], ImageStats()
    for kept, part in ordered_map(_encode_part, context, chunks(rows, ROWS_PER_PART), workers):
        examples += kept
        stats = stats.add(part)
    stats.examples = len(examples)
    stats.images = sum(len(e.images) for e in examples)
    return examples, stats


def _encode_part(context, rows: list) -> tuple[list[ImageExample], ImageStats]:
    """A part's examples, and its counts: rows, nothing to learn, and the rows whose images
    cannot be read, left out under --skip-bad-rows (else the first ends the run: one line)."""
    fmt, processing, assistant_only_loss, completion_only_loss, skip_bad_rows = context
    kept, stats = [], ImageStats(rows=len(rows))
    for where, row, folder in rows:
        try:
            example = encode_row(row, fmt, processing, f"--dataset {where}", folder,
                                 assistant_only_loss=assistant_only_loss,
                                 completion_only_loss=completion_only_loss)
        except UnreadableImage as error:
            if not skip_bad_rows:
                raise UnreadableImage(f"{error}; {SKIP_HINT}") from None
            stats.bad_rows += 1
            stats.bad_reason = stats.bad_reason or str(error)
            continue
        if example is None:
            stats.nothing_to_learn += 1
        else:
            kept.append(example)
    return kept, stats
