"""What happened and where the time went: engine counters (``stats``), the span recorder the engine
reports to (``timeline``) and the Lightning callback that logs both (``monitor``)."""
