"""Every mutant of tests/mutate.py still applies: its snippet occurs exactly once in its file. A refactor that moves
a snippet would otherwise turn the mutant into "not applied" and the mutation score would count fewer bugs than it
claims (three did, unnoticed, after the pack kernel and stage 3 were rewritten)."""

from pathlib import Path

import mutate
import pytest


@pytest.mark.parametrize("m", mutate.MUTANTS, ids=lambda m: m.name)
def test_the_mutant_applies_once(m):
    text = (Path(mutate.ROOT) / m.path).read_text()
    assert text.count(m.old) == 1, f"{m.name}: its snippet occurs {text.count(m.old)} times in {m.path}"
    assert m.old != m.new
