"""The small family of errors EdgeChat raises.

Every error is raised where the problem is detected and says what is wrong and
what to do about it. The CLIs turn any `EdgeChatError` into one line on stderr
and exit code 2, so users never see a traceback for bad input.
"""

from __future__ import annotations


class EdgeChatError(Exception):
    """Base class: a problem the user can act on."""


class MissingDependencyError(EdgeChatError, ImportError):
    """An optional package is needed for this feature."""

    def __init__(self, package: str, feature: str, install: str | None = None) -> None:
        self.package = package
        hint = install or f"pip install {package}"
        super().__init__(f"{feature} needs the package '{package}': {hint}")


class BundleError(EdgeChatError):
    """Something is wrong with a bundle folder."""


class ManifestError(BundleError):
    """manifest.json is missing, unreadable or does not follow the schema."""


class SchemaVersionError(ManifestError):
    """The manifest was written by a newer or unknown schema."""


class BundleFileMissingError(BundleError):
    """A file listed in the manifest is not in the bundle."""


class HashMismatchError(BundleError):
    """A file in the bundle does not have the size or SHA-256 the manifest records."""


class IncompleteBundleError(BundleError):
    """A half-written bundle (interrupted write) was found."""


class DimensionError(BundleError):
    """The model graph does not have the dimensions the manifest declares."""


class ProfileError(EdgeChatError):
    """A device profile is unknown or malformed."""


class ModelSourceError(EdgeChatError):
    """The model to load cannot be found or read."""


class ContextOverflowError(EdgeChatError):
    """A prompt does not fit in the model's context window."""


class RecipeError(EdgeChatError):
    """A recipe file or build option is invalid."""


class DataError(EdgeChatError):
    """Calibration / evaluation data is missing or malformed."""


class ParityError(EdgeChatError):
    """The exported graph does not reproduce the source model.

    Collects every mismatch before raising so one run shows all of them.
    """

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("exported model does not match the source model:\n  " + "\n  ".join(problems))
