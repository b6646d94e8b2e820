"""Texts and recordings of any length: estimated durations, AuK's instruction wording, splitting, joining.

Torch-free: the API plans a long job (``plan.py``) and the worker renders it (``render.py``) with the same code.

- ``duration.py``      how long a text takes to say (given, from a clip's transcript, or a speaking rate)
- ``instructions.py``  AuK's instruction wording, from the templates the model was trained on
- ``text.py``          cleaning and splitting a text into segments that fit one pass beside their clip
- ``windows.py``       overlapping windows over a long recording
- ``join.py``          cross-fades, pauses and loudness: segments into one waveform, incrementally
- ``timestamps.py``    the segments' times as JSON, SRT or WebVTT
- ``plan.py``          a request's parts into a stored plan (the API's side)
- ``render.py``        a plan rendered in GPU groups, segment by segment (the worker's side)
"""
