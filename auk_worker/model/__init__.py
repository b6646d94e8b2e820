"""The AuK model by stage, each in its plain torch form: thinker/ (stage 0, the prompt encoder), dit/ (stage 1's
backbone), sampling.py (the Euler solver), vae/ (the codec); streams.py and fp8.py serve the fast paths, which
the pipeline's wiring applies from outside (auk_worker/pipeline/wiring.py)."""
