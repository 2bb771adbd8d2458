"""Shared test plumbing: tables that tests want in the log are printed once, at the end."""

from __future__ import annotations

import pytest

_TABLES: list[tuple[str, str]] = []


@pytest.fixture
def report():
    """report(title, text): print ``text`` in the terminal summary of this pytest run."""
    return lambda title, text: _TABLES.append((title, text))


def pytest_terminal_summary(terminalreporter):
    for title, text in _TABLES:
        terminalreporter.section(title)
        terminalreporter.write_line(text)
