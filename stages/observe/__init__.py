"""Looking at runs: learning curves and per-type tables (``report``), one trajectory graph drawn
(``viz``), SQL over every table (``sql``), live logging to TensorBoard or JSON lines (``live_log``) and
terminal progress bars (``progress``). Nothing here changes a run's tables."""
