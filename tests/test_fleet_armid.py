from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fleet_samples import EVENT_ID, RG, SUB, event_arm_id, target_id
from forewarn.fleet.armid import (
    MAX_ARM_ID_LENGTH,
    ArmIdError,
    is_scheduled_event_id,
    parse_arm_id,
    same_resource,
    scheduled_event_id,
    split_scheduled_event_id,
    vm_id,
)

from strategies import any_text


def test_a_vm_id_splits_into_its_parts() -> None:
    arm = parse_arm_id(target_id("vm", "web-1"))
    assert arm.subscription_id == SUB and arm.resource_group == RG
    assert arm.namespace == "Microsoft.Compute" and arm.types == ("virtualMachines",) and arm.names == ("web-1",)
    assert arm.resource_type == "Microsoft.Compute/virtualMachines" and arm.name == "web-1"
    assert arm.parent is None
    assert str(arm) == target_id("vm", "web-1")


def test_a_child_resource_keeps_its_type_and_name_pairs() -> None:
    arm = parse_arm_id(f"{target_id('vmss', 'pool')}/virtualMachines/3")
    assert arm.types == ("virtualMachineScaleSets", "virtualMachines") and arm.names == ("pool", "3")
    assert arm.resource_type == "Microsoft.Compute/virtualMachineScaleSets/virtualMachines"


def test_a_scheduled_event_id_is_an_extension_of_its_target() -> None:
    arm = parse_arm_id(event_arm_id(target_id("vmss", "pool")))
    assert arm.resource_type == "Microsoft.Maintenance/scheduledevents" and arm.name == EVENT_ID
    assert arm.parent is not None and str(arm.parent) == target_id("vmss", "pool")
    assert arm.subscription_id == SUB and arm.resource_group == RG


def test_a_resource_named_providers_is_a_name_not_a_keyword() -> None:
    arm = parse_arm_id(target_id("vm", "providers"))
    assert arm.names == ("providers",) and arm.parent is None


def test_keywords_in_any_case_and_a_trailing_slash_normalise() -> None:
    lower = f"/SUBSCRIPTIONS/{SUB}/resourcegroups/{RG}/PROVIDERS/Microsoft.Compute/virtualMachines/vm-a/"
    assert str(parse_arm_id(lower)) == target_id("vm", "vm-a")


def test_subscription_level_resources_have_no_resource_group() -> None:
    arm = parse_arm_id(f"/subscriptions/{SUB}/providers/Microsoft.Maintenance/maintenanceConfigurations/weekly")
    assert arm.resource_group is None and str(arm).endswith("/maintenanceConfigurations/weekly")


def test_arm_ids_compare_without_regard_to_case() -> None:
    vm = target_id("vm", "Web-1")
    assert same_resource(vm, vm.lower())
    assert same_resource(parse_arm_id(vm.upper()), vm)
    assert parse_arm_id(vm) == parse_arm_id(vm.lower())
    assert len({parse_arm_id(vm), parse_arm_id(vm.upper())}) == 1
    assert not same_resource(vm, target_id("vm", "web-2"))
    assert not same_resource(vm, target_id("vmss", "Web-1"))


def test_same_resource_refuses_text_that_is_not_an_arm_id() -> None:
    with pytest.raises(ArmIdError):
        same_resource("web-1", target_id())


@pytest.mark.parametrize(("text", "says"), [
    ("", "must start with /subscriptions/"),
    ("subscriptions/x/resourceGroups/rg/providers/A.B/t/n", "must start with /subscriptions/"),
    ("/tenants/x/providers/A.B/t/n", "must start with /subscriptions/"),
    ("/subscriptions/", "must start with /subscriptions/"),
    ("//subscriptions/s/providers/A.B/t/n", "empty segment"),
    ("/subscriptions/s", "names no resource"),
    ("/subscriptions/s/resourceGroups/rg", "names no resource"),
    ("/subscriptions/s/resourceGroups", "resourceGroups has no name"),
    ("/subscriptions/s/resourceGroups/rg/Microsoft.Compute/virtualMachines/v", "expected /providers/"),
    ("/subscriptions/s/resourceGroups/rg/providers", "no namespace"),
    ("/subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute", "no resource type and name"),
    ("/subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/virtualMachines", "has no name"),
    ("/subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/virtualMachines//x", "empty segment"),
    ("/subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/virtualMachines/a?b", "control character"),
    ("/subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/virtualMachines/a\nb", "control character"),
    ("/subscriptions/s/resourceGroups/rg/providers/A.B/t/n/providers", "no namespace"),
    ("/subscriptions/s/resourceGroups/rg/providers/A.B/t/n" + "/t/n" * 20, "segments"),
    ("/subscriptions/s/resourceGroups/rg/providers/A.B/t/" + "n" * 300, "longer than"),
    ("/subscriptions/s/" + "x" * MAX_ARM_ID_LENGTH, "longer than"),
])
def test_text_that_is_not_an_arm_id_is_refused_with_the_reason(text: str, says: str) -> None:
    with pytest.raises(ArmIdError, match=says):
        parse_arm_id(text)


def test_a_refused_id_is_shown_clipped_in_the_message() -> None:
    with pytest.raises(ArmIdError) as caught:
        parse_arm_id("/subscriptions/s/" + "secret" * 100 + "/x")
    assert len(str(caught.value)) < 200


def test_the_scheduled_event_id_is_built_from_target_and_event_id() -> None:
    vmss = target_id("vmss", "pool")
    built = scheduled_event_id(vmss, EVENT_ID)
    assert built == event_arm_id(vmss)
    target, event_id = split_scheduled_event_id(built)
    assert str(target) == vmss and event_id == EVENT_ID
    assert is_scheduled_event_id(built) and is_scheduled_event_id(built.lower())
    assert not is_scheduled_event_id(vmss)


@pytest.mark.parametrize("event_id", ["", "a/b", "a?b", "x" * 300])
def test_an_event_id_that_cannot_be_a_segment_is_refused(event_id: str) -> None:
    with pytest.raises(ArmIdError):
        scheduled_event_id(target_id(), event_id)


def test_an_id_of_something_else_is_not_a_scheduled_event() -> None:
    with pytest.raises(ArmIdError, match="not a scheduled event"):
        split_scheduled_event_id(target_id())
    with pytest.raises(ArmIdError, match="not a scheduled event"):
        split_scheduled_event_id(f"{target_id()}/providers/Microsoft.ResourceHealth/resourceAnnotations/current")


def test_vm_id_builds_the_documented_shape_and_refuses_bad_names() -> None:
    assert vm_id(SUB, RG, "pool_3") == target_id("vm", "pool_3")
    for bad in ("", "a/b", "a\x00b"):
        with pytest.raises(ArmIdError):
            vm_id(SUB, RG, bad)


@given(any_text)
def test_parse_arm_id_raises_only_arm_id_error(text: str) -> None:
    try:
        parsed = parse_arm_id(text)
    except ArmIdError:
        return
    assert parse_arm_id(str(parsed)) == parsed


@given(st.lists(st.sampled_from(["subscriptions", "s", "resourceGroups", "rg", "providers", "A.B", "t", "n", ""]),
                max_size=12))
def test_any_arrangement_of_segments_parses_or_is_refused(segments: list[str]) -> None:
    text = "/" + "/".join(segments)
    try:
        parsed = parse_arm_id(text)
    except ArmIdError:
        return
    assert same_resource(str(parsed), text)
