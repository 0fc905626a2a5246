"""Scripts written from ART 0.5's documentation pages, with ``import art`` changed to
``import tracerl as art`` and nothing else of ART's API changed. Two adaptations, the same in
each: ``backend = LocalBackend()`` becomes the shared test backend given to ``main``, and the
base model, group counts and ``max_tokens`` shrink to SmolLM2 on CPU sizes."""
