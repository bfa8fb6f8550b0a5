"""The code location of the one-run-at-a-time end-to-end test: the example project's `clicks`
pipeline (its own operators) alone, with its input sensor on."""

from clickstream.pipelines import clicks

from sparkpoint import build_pipeline_defs

defs = build_pipeline_defs(clicks)
