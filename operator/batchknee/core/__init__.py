"""The pure planner: roofline physics, catalogs, recommendation and calibration. No I/O, no clock."""

from batchknee.core.calibration import (
    LinearTpotFit,
    RooflineCalibration,
    StepSample,
    fit_linear_tpot,
    fit_roofline,
)
from batchknee.core.catalog import (
    GPUS,
    MODELS,
    CatalogError,
    GpuSpec,
    ModelArchitecture,
    find_gpu,
    find_model,
)
from batchknee.core.recommend import Recommendation, recommend
from batchknee.core.roofline import DEFAULT_RESERVE_BYTES, DecodeRoofline

__all__ = [
    "DEFAULT_RESERVE_BYTES",
    "GPUS",
    "MODELS",
    "CatalogError",
    "DecodeRoofline",
    "GpuSpec",
    "LinearTpotFit",
    "ModelArchitecture",
    "Recommendation",
    "RooflineCalibration",
    "StepSample",
    "find_gpu",
    "find_model",
    "fit_linear_tpot",
    "fit_roofline",
    "recommend",
]
