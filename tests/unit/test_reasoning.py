"""The thinking of `<think>` models told apart from the answer, whole and in pieces of any size alike."""

from __future__ import annotations

import random

import pytest

from preft.gateway.openai.reasoning import Thinking


@pytest.mark.parametrize(
    ("opened", "text", "split"),
    [
        (False, "<think>Two and two.</think>\n\nFour.", ("Two and two.", "\n\nFour.")),
        (False, "\n <think>a</think>b", ("a", "b")),
        (False, "Four.", ("", "Four.")),
        (False, " Four <think>x</think>", ("", " Four <think>x</think>")),  # (thinking only at the start)
        (False, "<think>cut short", ("cut short", "")),
        (False, "<thi", ("", "<thi")),
        (False, "  ", ("", "  ")),
        (False, "", ("", "")),
        (True, "Two and two.</think>Four.", ("Two and two.", "Four.")),  # (the prompt opened it)
        (True, "cut short </thi", ("cut short </thi", "")),
        (True, "</think></think>", ("", "</think>")),
    ],
)
def test_whole_answers_split_at_the_closing_tag(opened, text, split):
    assert Thinking(opened).split(text) == split


def test_pieces_of_any_size_split_as_the_whole_answer():
    rng = random.Random(5)
    words = ["<think>", "</think>", "<", "</", "</th", "<thi", "think>", "a", " ", "\n", "b c", ">"]
    for _ in range(3000):
        text = "".join(rng.choice(words) for _ in range(rng.randint(0, 12)))
        opened = rng.random() < 0.3
        splitter = Thinking(opened).splitter()
        reasoning, content, at = "", "", 0
        while at < len(text):
            size = rng.randint(1, 5)
            r, c = splitter.feed(text[at : at + size], last=at + size >= len(text))
            reasoning, content, at = reasoning + r, content + c, at + size
        if not text:
            reasoning, content = splitter.feed("", last=True)
        assert (reasoning, content) == Thinking(opened).split(text), text


@pytest.mark.parametrize(
    ("tail", "opened"),
    [("<|im_start|>assistant\n<think>\n", True), ("<|Assistant|><think>", True), ("<|im_start|>assistant\n", False)],
)
def test_a_template_that_starts_the_answer_thinking(tail, opened):
    assert Thinking.of_prompt(tail).opened is opened


def test_thinking_tokens_are_counted_alike_whole_and_token_by_token():
    """A whole answer counts its tokens up to the one that completes </think> (all while cut short, none without
    thinking); fed a token at a time, the splitter counts the same."""
    rng = random.Random(8)
    vocab = ["<think>", "</think>", "<", "</", "th", "ink>", "think>", "a", " ", "\n", "bc"]

    def decode(ids: list[int]) -> str:
        return "".join(vocab[i] for i in ids)

    def counted(opened: bool, ids: list[int]) -> int:
        return Thinking(opened).tokens(decode(ids), ids, decode)

    assert counted(False, [0, 7, 1, 10]) == 3
    assert counted(False, [0, 7, 3, 4, 5, 10]) == 5  # ("</" "th" "ink>": the third completes it)
    assert counted(True, [7, 8, 1, 10]) == 3
    assert counted(False, [0, 7, 7]) == 3  # (cut short)
    assert counted(False, [10, 0, 1]) == 0
    for _ in range(2000):
        ids = [rng.randrange(len(vocab)) for _ in range(rng.randint(0, 10))]
        thinking = Thinking(rng.random() < 0.3)
        splitter = thinking.splitter()
        for at, token in enumerate(ids):
            splitter.feed(vocab[token], last=at == len(ids) - 1, tokens=1)
        assert splitter.tokens == thinking.tokens(decode(ids), ids, decode), [vocab[i] for i in ids]
