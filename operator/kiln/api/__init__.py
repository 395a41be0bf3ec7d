"""TrainingJob API (kiln.dev/v1alpha1): spec and status types, defaults, validation.

The single source of truth for the job format. `kiln.crd` generates the CRD's
structural schema from these types; the CLI, the local runner, the trainer and
the operator all parse jobs through `parse_job`. Python names are snake_case,
the wire names camelCase (one alias generator, in `names.ApiModel`).

Two kinds of checks:
  * single-field checks (types, enums, bounds, unknown fields) live in the types
    and therefore also in the CRD schema; `check_schema` runs exactly these;
  * cross-field checks live in `validate` and report every problem as
    ``field.path: what is wrong (got X); fix``.

Callers import this package only (``from kiln import api``; ``api.TrainingJob``); it re-exports
the names of its modules, which import downwards only (validation → status → spec → names):

  * `names`: group/version/kind, name patterns and bounds, the wire enums (`Phase`,
    `ConditionType`, `Reason`, the spec fields' enums), `InvalidSpec` and the `ApiModel` base;
  * `spec`: `TrainingJobSpec` and its sections, with defaults, bounds and field docs, and
    `ObjectMeta`;
  * `status`: `TrainingJobStatus` and its parts, and `TrainingJob`, the whole object;
  * `validation`: `parse_job`, `check_schema`, `validate` (cross-field rules) and `to_wire`.

Non-goals: no I/O beyond reading YAML text, never imports torch or kopf.
"""

from __future__ import annotations

from kiln.api import names, spec, status, validation

# Re-exports: the API's names, so callers write `api.X` wherever X lives.
GROUP = names.GROUP
VERSION = names.VERSION
API_VERSION = names.API_VERSION
KIND = names.KIND
PLURAL = names.PLURAL
SINGULAR = names.SINGULAR
SHORT_NAMES = names.SHORT_NAMES
CATEGORIES = names.CATEGORIES
NAME_PATTERN = names.NAME_PATTERN
NAME_MAX_LENGTH = names.NAME_MAX_LENGTH
PARENT_PATTERN = names.PARENT_PATTERN
PARENT_MAX_LENGTH = names.PARENT_MAX_LENGTH
INPUT_DIM_MAX = names.INPUT_DIM_MAX
TORCHVISION_CLASSES = names.TORCHVISION_CLASSES
InvalidSpec = names.InvalidSpec
Phase = names.Phase
ConditionType = names.ConditionType
Reason = names.Reason
TargetMetric = names.TargetMetric
DatasetName = names.DatasetName
Augmentation = names.Augmentation
OptimizerName = names.OptimizerName
ScheduleName = names.ScheduleName
Parallelism = names.Parallelism
CleanPodPolicy = names.CleanPodPolicy
FreezingMode = names.FreezingMode
CacheMode = names.CacheMode

PositiveInt = spec.PositiveInt
InputDim = spec.InputDim
ModelSpec = spec.ModelSpec
DatasetSpec = spec.DatasetSpec
OptimizerSpec = spec.OptimizerSpec
LrScheduleSpec = spec.LrScheduleSpec
TrainingSpec = spec.TrainingSpec
TargetSpec = spec.TargetSpec
WarmStartSpec = spec.WarmStartSpec
FreezingSpec = spec.FreezingSpec
ResourcesSpec = spec.ResourcesSpec
ZooSpec = spec.ZooSpec
RunPolicySpec = spec.RunPolicySpec
TrainingJobSpec = spec.TrainingJobSpec
ObjectMeta = spec.ObjectMeta

Condition = status.Condition
WarmStartStatus = status.WarmStartStatus
PlacementStatus = status.PlacementStatus
ProgressStatus = status.ProgressStatus
ResultStatus = status.ResultStatus
TrainingJobStatus = status.TrainingJobStatus
TrainingJob = status.TrainingJob

parse_job = validation.parse_job
check_schema = validation.check_schema
validate = validation.validate
to_wire = validation.to_wire
