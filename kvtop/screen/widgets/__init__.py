"""The dashboard's widgets and modal screens; each renders frozen snapshots handed to it."""

from kvtop.screen.widgets.devices import DevicePanel
from kvtop.screen.widgets.eventlog import EventLog
from kvtop.screen.widgets.frag import FragSummary
from kvtop.screen.widgets.modals import (
    ConfirmScreen,
    DetailsScreen,
    FilterScreen,
    HelpScreen,
    LimitRequest,
    LimitScreen,
    PolicyRequest,
    PolicyScreen,
)
from kvtop.screen.widgets.models import ModelTable
from kvtop.screen.widgets.pagemap_view import PageMapView
from kvtop.screen.widgets.status import StatusLine

__all__ = [
    "ConfirmScreen", "DetailsScreen", "DevicePanel", "EventLog", "FilterScreen", "FragSummary", "HelpScreen",
    "LimitRequest", "LimitScreen", "ModelTable", "PageMapView", "PolicyRequest", "PolicyScreen", "StatusLine",
]
