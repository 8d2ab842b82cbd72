"""The dashboard's widgets and modal screens; each renders frozen snapshots handed to it."""

from kvtop.widgets.devices import DevicePanel
from kvtop.widgets.eventlog import EventLog
from kvtop.widgets.frag import FragSummary
from kvtop.widgets.modals import (
    ConfirmScreen,
    DetailsScreen,
    FilterScreen,
    HelpScreen,
    LimitRequest,
    LimitScreen,
    PolicyRequest,
    PolicyScreen,
)
from kvtop.widgets.models import ModelTable
from kvtop.widgets.pagemap_view import PageMapView
from kvtop.widgets.status import StatusLine

__all__ = [
    "ConfirmScreen", "DetailsScreen", "DevicePanel", "EventLog", "FilterScreen", "FragSummary", "HelpScreen",
    "LimitRequest", "LimitScreen", "ModelTable", "PageMapView", "PolicyRequest", "PolicyScreen", "StatusLine",
]
