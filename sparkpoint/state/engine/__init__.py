"""The storage engine of keyed state: RocksDB (`rocksdb`), its column families as the kinds'
stores (`stores`), a subtask's local state (`localstate`), the snapshot and restore strategies
(`snapshotting`, `restoring`) and the RocksDB steps a restore takes (`rebuilding`), the changelog
and its materialization in steps (`changelog`, `staging`), task-local copies (`restore`), SST
files (`sstfile`), local file writes (`localfiles`), and the checks and repair of stored files
(`verify`, `repair`).

It imports the state model (`sparkpoint.state.kinds`, `keygroups`, ...) for what it stores; the
model never imports it.
"""
