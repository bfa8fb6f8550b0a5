"""The kinds of keyed state an operator opens: one module per kind over one base (`base`).

`ValueState` (`value`), `MapState` (`map`), `ListState` (`list`), `ReducingState` (`reducing`);
each module imports only `base`, which holds what they share and the one interface to storage
they need (`StateStore`).
"""

from sparkpoint.state.kinds.base import KeyedState, StateStore
from sparkpoint.state.kinds.list import ListState
from sparkpoint.state.kinds.map import MapState
from sparkpoint.state.kinds.reducing import ReducingState
from sparkpoint.state.kinds.value import ValueState

__all__ = ["KeyedState", "ListState", "MapState", "ReducingState", "StateStore", "ValueState"]
