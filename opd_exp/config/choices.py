"""Closed choices that can still grow: an enum kept in step with a registry of implementations."""

from __future__ import annotations

from enum import Enum


class RegistryChoice(Enum):
    """An enum whose members are the names in a registry, kept in step with it: a name
    registered later (``register_divergence``, ``register_teacher_scorer``) becomes a member, so OmegaConf accepts it and
    an unknown name still fails with the list of valid ones."""

    @classmethod
    def _missing_(cls, value):
        # a pickled member from a process whose plugins registered it (joblib launcher jobs)
        from opd_exp.config.plugins import load_plugins

        load_plugins()
        return cls._value2member_map_.get(value)

    @classmethod
    def _add(cls, value: str) -> None:
        if value in cls._value2member_map_:
            return
        member = object.__new__(cls)
        member._name_ = member._value_ = value
        member.__objclass__ = cls
        member.__init__(value)
        setattr(cls, value, member)  # DivergenceName.<name>, before it is a member (no reassign check)
        cls._member_names_.append(value)
        cls._member_map_[value] = member
        cls._value2member_map_[value] = member
