"""The `--conf` keys of tables: `iceberg.catalog.<property>=<value>` names a property of the
Iceberg catalog an `iceberg://<catalog>/<namespace>.<table>` URL loads its table from (`uri`,
`warehouse`, `type`, ...: pyiceberg's `load_catalog` properties), for the input and the output
alike. They are not pipeline settings: the CLI takes them apart before the settings are read.
"""

from __future__ import annotations

from collections.abc import Mapping

CATALOG_PREFIX = "iceberg.catalog."


def split_catalog_conf(conf: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(the Iceberg catalog properties among `conf`, by property name; the other keys).

    `{"iceberg.catalog.uri": "sqlite:///cat.db", "parallelism.default": "2"}` gives
    `({"uri": "sqlite:///cat.db"}, {"parallelism.default": "2"})`.
    """
    catalog = {k[len(CATALOG_PREFIX):]: v for k, v in conf.items() if k.startswith(CATALOG_PREFIX)}
    if "" in catalog:
        raise ValueError(f"--conf {CATALOG_PREFIX}=... names no property: write {CATALOG_PREFIX}<property>=<value>")
    return catalog, {k: v for k, v in conf.items() if not k.startswith(CATALOG_PREFIX)}
