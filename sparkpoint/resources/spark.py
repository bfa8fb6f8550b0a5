"""The Spark resource."""

from __future__ import annotations

from typing import Any

import dagster as dg
from pydantic import PrivateAttr

from sparkpoint.checkpoint.errors import SparkpointError
from sparkpoint.pipeline.driver import StatefulPipeline
from sparkpoint.resources.fields import ResourceConfigError, json_object


class SparkResource(dg.ConfigurableResource):  # type: ignore[type-arg]
    """A Spark session: by default the warm local Spark (a Spark Connect server on 127.0.0.1 that
    sparkpoint starts on first use and keeps warm: `sparkpoint.spark.warm`), any master URL
    (`local[2]`: a Spark in the run's own process), extra conf as JSON; or, with `remote`
    (`sc://host:port`), a Spark Connect client of a Spark that is already up. On Connect the runs
    of a pipeline share a server session (its Python workers stay warm between runs; see
    `sparkpoint.spark.session`): `session_for`."""

    master: str = ""  # "": the warm local Spark (SPARKPOINT_WARM_SPARK=off: local[2] in the run's process)
    remote: str = ""  # Spark Connect URL; wins over `master`
    conf: str = "{}"  # JSON object of Spark settings
    app_name: str = "sparkpoint"
    stop_on_teardown: bool = True
    _session: Any = PrivateAttr(default=None)
    _remote: str | None = PrivateAttr(default=None)
    _master: str | None = PrivateAttr(default=None)
    _conf: dict[str, Any] = PrivateAttr(default_factory=dict)

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        self._conf = json_object(self.conf, "spark: conf")
        from sparkpoint.spark.session import check_reachable, spark_session
        from sparkpoint.spark.warm import default_spark, proven_server

        self._remote = self.remote or str(self._conf.pop("spark.remote", "")) or None
        try:
            self._master, self._remote = default_spark(self.master or None, self._remote)
            if self._remote:  # the session itself when a step knows its pipeline (`session_for`)
                check_reachable(self._remote)
                warm = proven_server(self._remote)
                if warm is not None and context.log is not None:  # a shared server says whose it is
                    context.log.info(f"Spark: attached to {warm.describe()}")
            else:
                self._session = spark_session(self._master, app_name=self.app_name)
        except SparkpointError as e:
            raise ResourceConfigError(f"spark (master, remote): {e}") from e
        if self._session is not None:
            self._configure()

    def _configure(self) -> None:
        for key, value in self._conf.items():
            self._session.conf.set(key, str(value))

    def session_for(self, driver: StatefulPipeline) -> Any:
        """The session to run `driver`'s batches on: on Spark Connect, the server session its
        runs share (same job, same code)."""
        if self._session is None and self._remote:
            from sparkpoint.spark.session import session_key

            self._connect(session_key(driver.config.job_id, driver.operators, self._conf))
        return self.session

    def _connect(self, share: str | None) -> None:
        from sparkpoint.spark.session import spark_session

        try:
            self._session = spark_session(self._master, app_name=self.app_name, remote=self._remote, share=share)
        except SparkpointError as e:
            # As when setup refused it: a configuration error, which no recovery run heals (the
            # recovery sensor reads the causes too).
            raise ResourceConfigError(f"spark (master, remote): {e}") from None
        self._configure()

    def teardown_after_execution(self, context: dg.InitResourceContext) -> None:
        if self._session is not None and self.stop_on_teardown:
            self._session.stop()  # PySpark never stops it by itself (a shared Connect session: this client only)
        self._session, self._remote = None, None

    @property
    def session(self) -> Any:
        if self._session is None and self._remote:  # for no pipeline in particular: a session of its own
            self._connect(None)
        if self._session is None:
            raise ResourceConfigError("spark: the session exists only while a step runs")
        return self._session
