"""Where the verdict's counts come from, one module per source: a Prometheus server (:mod:`.prometheus`), a saved
exposition (:mod:`.exposition`), or journals (:mod:`.journals`, their lines checked by :mod:`.journal_lines`); what
they share is :mod:`.common`.

Sources are data from elsewhere and are checked as such: a source that is not what it claims (binary, not
UTF-8, too large, malformed), or whose counts cannot be counts (negative, fractional where they must be whole,
not finite, beyond what a float counts exactly) raises :class:`SourceError` naming the source and what is wrong.
Reading is bounded in time and memory.
"""

from shadow.analysis.sources.common import (
    CLUSTER_WINDOW_SECONDS,
    SourceError,
    read_text,
    run_names,
    select_run,
)
from shadow.analysis.sources.exposition import environment_from_exposition, from_exposition
from shadow.analysis.sources.journal_lines import journal_records, rotated_siblings, with_rotated
from shadow.analysis.sources.journals import JournalReader, from_journal, patch_calls
from shadow.analysis.sources.prometheus import from_prometheus, patch_calls_from_prometheus

__all__ = [
    "CLUSTER_WINDOW_SECONDS",
    "JournalReader",
    "SourceError",
    "environment_from_exposition",
    "from_exposition",
    "from_journal",
    "from_prometheus",
    "journal_records",
    "patch_calls",
    "patch_calls_from_prometheus",
    "read_text",
    "rotated_siblings",
    "run_names",
    "select_run",
    "with_rotated",
]
