"""The code location of the UI and end-to-end tests: the sample pipeline (`sparkpoint.definitions`)
beside a second pipeline of its own operators (the example project's `clicks`), merged as a user
merges theirs."""

import dagster as dg
from clickstream.pipelines import clicks

from sparkpoint import build_pipeline_defs
from sparkpoint.definitions import defs as sample

defs = dg.Definitions.merge(sample, build_pipeline_defs(clicks))
