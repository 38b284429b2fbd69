"""Tools that read the evidence after (or while) a job runs: ``verdict`` (promote / rollback / inconclusive)
and its checked ``sources``, ``report`` (Markdown and HTML) and ``replay`` (a captured call run again)."""
