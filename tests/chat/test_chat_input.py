"""How the chat prompt joins what is typed or pasted into messages (`apirctl.chat.composer.Composer`)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from apirctl.chat.composer import CONTINUATION, PROMPT, Composer, Entry


def feed_all(composer: Composer, *inputs: str) -> list[Entry]:
    """What the session gets from a series of `input()` results."""
    return [entry for text in inputs for entry in composer.feed(text)]


def test_a_line_is_a_message_or_a_command() -> None:
    composer = Composer()
    assert feed_all(composer, "  hello there  ") == [Entry("hello there")]
    assert feed_all(composer, "/system Be brief.") == [Entry("/system Be brief.", command=True)]
    assert composer.prompt == PROMPT and not composer.pending


def test_a_block_keeps_its_lines_as_typed() -> None:
    composer = Composer()
    assert feed_all(composer, '"""') == []
    assert composer.pending and composer.prompt == CONTINUATION
    done = feed_all(composer, "def f(x):", '    """Twice x."""', "", "    return 2 * x", '"""')
    assert done == [Entry('def f(x):\n    """Twice x."""\n\n    return 2 * x')]
    assert composer.prompt == PROMPT


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        (['"""first line', "second", '"""'], "first line\nsecond"),  # text after the opening quotes
        (['"""one line"""'], "one line"),
        (['   """', "x", '  """  '], "x"),  # quotes with spaces around them still open and close
        (['"""', "/system not a command", '"""'], "/system not a command"),
        (['"""', "", "  indented", "", '"""'], "indented"),  # one line left: stripped
    ],
)
def test_block_forms(inputs: list[str], message: str) -> None:
    assert feed_all(Composer(), *inputs) == [Entry(message)]


def test_trailing_backslash_continues_on_the_next_line() -> None:
    composer = Composer()
    assert feed_all(composer, "first part\\") == []
    assert composer.prompt == CONTINUATION
    assert feed_all(composer, "  second part\\", "third") == [Entry("first part\n  second part\nthird")]
    # A command may go on too: its argument spans lines.
    assert feed_all(composer, "/system You are\\", "a pirate.") == [Entry("/system You are\na pirate.", command=True)]
    # A continued line that starts with quotes does not open a block.
    assert feed_all(composer, "see\\", '"""\\', "end") == [Entry('see\n"""\nend')]


def test_a_paste_is_one_message() -> None:
    """Bracketed paste: input() returns all pasted lines at once, usually with the final newline."""
    assert feed_all(Composer(), "line one\n  line two\\\n\nline four\n") == [
        Entry("line one\n  line two\\\n\nline four")  # a backslash inside a paste is text
    ]
    # A paste that ends in a backslash goes on, like a typed line.
    composer = Composer()
    assert feed_all(composer, "a\nb\\") == []
    assert feed_all(composer, "c") == [Entry("a\nb\nc")]
    # A pasted block, and what follows its end.
    assert feed_all(Composer(), '"""\nx = 1\n"""\nnext question\n') == [Entry("x = 1"), Entry("next question")]


def test_ctrl_c_drops_and_ctrl_d_sends_a_pending_message() -> None:
    composer = Composer()
    feed_all(composer, '"""', "draft")
    composer.cancel()
    assert not composer.pending and composer.finish() is None
    assert feed_all(composer, "fresh") == [Entry("fresh")]
    feed_all(composer, '"""', "/keep", "this")
    assert composer.finish() == Entry("/keep\nthis")  # a block is never a command
    feed_all(composer, "/system a\\")
    assert composer.finish() == Entry("/system a", command=True)
    assert not composer.pending


LINE = st.text(alphabet=st.characters(blacklist_categories=["Cs", "Cc"]), max_size=20)
EDGE = LINE.filter(lambda line: bool(line.strip()) and line.strip() != '"""')


@given(EDGE, st.lists(LINE.filter(lambda line: line.strip() != '"""'), max_size=6), EDGE)
def test_any_block_arrives_as_typed(first: str, middle: list[str], last: str) -> None:
    """Every line of a block is kept verbatim (spaces, empty lines, quotes, backslashes)."""
    lines = [first, *middle, last]
    assert feed_all(Composer(), '"""', *lines, '"""') == [Entry("\n".join(lines))]
