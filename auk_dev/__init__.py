"""Development and test tooling, apart from the engine and the service: ``make run``'s demo (``demo.py``) and its
supervisor, managers for local Redis, Sentinel and SeaweedFS processes and for worker and API subprocesses
(``local.py``, ``local_sentinel.py``), and the tiny checkpoint in the release layout (``tiny.py``, with its
offline tokenizer and thinker in ``tiny_qwen.py``) that tests, CI and the demo render with."""
