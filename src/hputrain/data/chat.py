"""Chat templates: rendering a conversation, finding each assistant turn's text in it, and the
tokens the model should learn.

The rule for a turn's learned text. A template renders a conversation as text; an assistant
turn's text is what rendering the conversation up to and including that turn adds to rendering
the conversation before it with the generation prompt (add_generation_prompt=True): everything
the model has to generate after the prompt, so the assistant's content (with Mistral's space
before it) and the template's end of turn (`<|im_end|>`, `<|eot_id|>`, `</s>`, `<end_of_turn>`,
`<|end|>`). Not learned: whitespace at the end of the turn's text (ChatML's newline after
`<|im_end|>`: generation stops at the marker, the model never writes the newline), and text a
template writes only where a conversation ends (Phi-3's closing `<|endoftext|>`, found by
rendering the conversation with one more message after the turn).

Templates that mark the assistant's text with `{% generation %}` get transformers' own
assistant mask (return_assistant_tokens_mask), extended from the last marked token of each turn
through that turn's end of turn when the marks stop before it: the end marker is always learned.
When the marks cover the content and the end marker, the two ways agree token for token, which
the tests check for each template family.

Character spans become tokens by the fast tokenizer's offsets: a token is learned when any of its
characters is (transformers' char_to_token rule). A template whose renderings are not prefixes of
one another (Mistral v0.3 moves the system prompt into the last user message; templates that drop
the reasoning of earlier turns) cannot be cut this way: one InputError naming it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError

GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
"""The start of a `{% generation %}` block in a chat template."""

PROBE = {"role": "user", "content": "x"}
"""A message rendered after a conversation's last turn to find the template's closing text."""


@dataclass(frozen=True)
class Turn:
    """An assistant turn's place in the rendered conversation, as character offsets."""

    start: int
    """Where the turn's text starts (after the header the generation prompt writes)."""
    end: int
    """Where it ends, closing text left out (whitespace included)."""
    learned_end: int
    """`end` without the whitespace before it."""


class ChatTemplate:
    """A tokenizer's chat template, applied to the rows of one data set.

    `name` is how errors call the template (the tokenizer's name_or_path by default); `where`
    says which row is being read, so an error names it.
    """

    def __init__(self, tokenizer, name: str | None = None) -> None:
        try:
            template = tokenizer.get_chat_template()
        except ValueError:
            template = None
        self.name = name or getattr(tokenizer, "name_or_path", "") or "of the tokenizer"
        if not isinstance(template, str):
            raise InputError(f"the tokenizer {self.name} has no chat template: give a tokenizer "
                             "with one (tokenizer.chat_template), or the data as text")
        if not getattr(tokenizer, "is_fast", False):
            raise InputError(f"the tokenizer {self.name} is not a fast tokenizer: assistant masks "
                             "need its character offsets (install `tokenizers`)")
        self.tokenizer = tokenizer
        self.tagged = bool(GENERATION_TAG.search(template))

    def render(self, messages: list[dict], add_generation_prompt: bool, where: str) -> str:
        """The template's text for `messages`; a template that refuses them is an InputError."""
        from jinja2.exceptions import TemplateError

        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        except TemplateError as error:
            raise InputError(f"{where}: the chat template {self.name} refuses the conversation: "
                             f"{error}") from None

    def tokenize(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids and character offsets of rendered text (no special tokens added: the template
        writes its own, as apply_chat_template tokenizes)."""
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(encoded["input_ids"]), [tuple(o) for o in encoded["offset_mapping"]]

    def turns(self, full: str, offsets: list[tuple[int, int]], messages: list[dict],
              learned: list[int], where: str) -> list[Turn]:
        """The place in `full` (the rendered conversation, its tokens' `offsets`) of each assistant
        turn among the message indices `learned` (other roles are passed over). A turn with
        nothing before it (the first message) has no place: nothing predicts it, it is not learned."""
        token_ends = sorted({end for _, end in offsets})
        last = len(messages) - 1
        found = []
        for i in (i for i in learned if i > 0 and messages[i]["role"] == "assistant"):
            before = self.render(messages[:i], True, where)
            upto = full if i == last else self.render(messages[:i + 1], False, where)
            after = full if i < last else self.render(messages + [PROBE], False, where)
            if not (upto.startswith(before) and after.startswith(before)):
                raise self._not_prefixes(where, i)
            # The turn's text runs as far as `upto` and `after` agree (past it: the next message,
            # or text written only at a conversation's end, which must then end `after` too),
            # cut back to where a token of the conversation ends, so that a character the two
            # share by chance ('<' of `<|endoftext|>` and of `<|user|>`) is not taken for the turn's.
            common = len(os.path.commonprefix([upto, after]))
            if not after.endswith(upto[common:]):
                raise self._not_prefixes(where, i)
            end = max((e for e in token_ends if len(before) <= e <= common), default=len(before))
            learned_end = end
            while learned_end > len(before) and full[learned_end - 1].isspace():
                learned_end -= 1
            found.append(Turn(len(before), end, learned_end))
        return found

    def end_of_turn(self) -> str | None:
        """The text the template writes after an assistant's content to end its turn
        (`<|im_end|>`, `<|eot_id|>`, `</s>`, `<end_of_turn>`, `<|end|>`), found by the turn rule
        above on a probe conversation: what generation must stop at. None where the turn's text
        has nothing after the content, or the template refuses the probe. The probe's contents
        are strings, then text parts where the template prints no string content or refuses it
        (LLaVA-1.5's prints only parts of type "text")."""
        content = "hputrain probe answer"
        messages = [{"role": "user", "content": "hputrain probe question"},
                    {"role": "assistant", "content": content}]
        for probe in (messages, [{**m, "content": [{"type": "text", "text": m["content"]}]}
                                 for m in messages]):
            try:
                full = self.render(probe, False, "the end-of-turn probe")
                offsets = self.tokenize(full)[1]
                (turn,) = self.turns(full, offsets, probe, [1], "the end-of-turn probe")
            except InputError:
                continue
            text = full[turn.start:turn.learned_end]
            at = text.find(content)
            if at >= 0:
                return text[at + len(content):].strip() or None
        return None

    def _not_prefixes(self, where: str, i: int) -> InputError:
        return InputError(
            f"{where}: the chat template {self.name} renders message {i} differently once later "
            "messages follow (its renderings are not prefixes of one another), so the assistant's "
            "turns cannot be found in it: use a template that marks them with {% generation %}, "
            "or one whose renderings extend each other")

    def assistant_mask(self, messages: list[dict], learned: list[int],
                       where: str) -> tuple[list[int], list[bool]]:
        """Token ids of the rendered conversation and, per token, whether it is learned: the
        tokens of the assistant turns `learned` (message indices), end of turn included."""
        full = self.render(messages, False, where)
        ids, offsets = self.tokenize(full)
        turns = self.turns(full, offsets, messages, learned, where)
        mask = [False] * len(ids)
        if self.tagged:
            marked = self._marked(messages, ids, where)
        for turn in turns:
            inside = [k for k, (s, e) in enumerate(offsets) if s < turn.end and e > turn.start]
            learned = [k for k in inside if _overlaps(offsets[k], turn.start, turn.learned_end)]
            if self.tagged:  # the template's marks, then on from the last marked token to the end
                tagged = [k for k in inside if marked[k]]
                learned = sorted(set(tagged) | {k for k in learned if tagged and k > tagged[-1]})
            for k in learned:
                mask[k] = True
        return ids, mask

    def _marked(self, messages: list[dict], ids: list[int], where: str) -> list[bool]:
        """transformers' assistant mask: the tokens of the text inside `{% generation %}`."""
        from jinja2.exceptions import TemplateError

        try:
            out = self.tokenizer.apply_chat_template(
                messages, return_dict=True, return_assistant_tokens_mask=True)
        except TemplateError as error:
            raise InputError(f"{where}: the chat template {self.name} refuses the conversation: "
                             f"{error}") from None
        if list(out["input_ids"]) != ids:  # both tokenize the same rendering
            raise InputError(f"{where}: the chat template {self.name} renders differently when "
                             "asked for the assistant mask")
        return [bool(m) for m in out["assistant_masks"]]


def _overlaps(offset: tuple[int, int], start: int, end: int) -> bool:
    """Whether a token's characters [offset) meet [start, end) (a token the tokenizer added has
    the empty offset (0, 0) and meets nothing)."""
    return offset[0] < end and offset[1] > start


def use_chat_template(tokenizer, file: str | None) -> None:
    """Replace the tokenizer's chat template with the Jinja text of `file` (--chat-template); it is
    then the one saved with the tokenizer."""
    if file is None:
        return
    try:
        text = Path(file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"--chat-template {file} cannot be read: "
                         f"{getattr(exc, 'strerror', None) or exc}") from None
    if not text.strip():
        raise InputError(f"--chat-template {file} is empty: give a Jinja chat template")
    tokenizer.chat_template = text


def render_ids(tokenizer, messages: list[dict], where: str, *, generation_prompt: bool = False,
               tools=None) -> list[int]:
    """The token ids of `messages` rendered by the tokenizer's chat template (with the generation
    prompt, and `tools` where the row has them), or one line naming `where` when the tokenizer has
    no template or the template refuses the conversation: DPO's pairs, a reward model's."""
    if not getattr(tokenizer, "chat_template", None):
        raise InputError(f"{where} holds conversations, but the tokenizer has no chat template: "
                         "pass --chat-template FILE (a Jinja chat template)")
    try:
        ids = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                            add_generation_prompt=generation_prompt)["input_ids"]
    except Exception as exc:  # the template's own raise_exception(), a Jinja error
        raise InputError(f"{where}: the chat template cannot render it: {exc}") from None
    return list(ids)


def chat_template(tokenizer, fmt: str) -> ChatTemplate:
    """The tokenizer's chat template, which `fmt` rows (an SFT row shape) need; one line without one."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise InputError(f"the tokenizer of --model {getattr(tokenizer, 'name_or_path', '')} has no "
                         f"chat template, which {fmt} rows need: pass --chat-template FILE (a Jinja "
                         "chat template)")
    return ChatTemplate(tokenizer)
