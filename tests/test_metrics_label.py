"""Label values cut to what a scrape's limits take: at most 512 characters and 1,023 bytes of UTF-8
(labelValueLengthLimit in Azure Monitor managed Prometheus' scrape objects; a breach drops the whole scrape)."""

from hypothesis import given
from hypothesis import strategies as st

from forewarn.metrics.events import MAX_LABEL_BYTES, MAX_LABEL_CHARS, label

TEXT = st.text(alphabet=st.sampled_from(["a", "é", "中", "😀", " "]), max_size=1500) | st.text(max_size=1500)


@given(TEXT)
def test_a_label_value_keeps_within_both_limits_and_keeps_what_fits(value: str) -> None:
    kept = label(value)
    assert len(kept) <= MAX_LABEL_CHARS
    assert len(kept.encode("utf-8")) <= MAX_LABEL_BYTES
    if len(value) <= MAX_LABEL_CHARS and len(value.encode("utf-8")) <= MAX_LABEL_BYTES:
        assert kept == value
    else:
        assert kept.endswith("...")
        assert value.startswith(kept[:-3])


def test_a_non_latin_description_is_cut_by_bytes_on_a_character_boundary() -> None:
    value = "中" * 500                          # 500 characters, 1,500 bytes
    kept = label(value)
    assert kept == "中" * 340 + "..."           # 1,020 bytes of whole characters, then the mark
    assert label("中" * 341) == "中" * 341      # 1,023 bytes: fits as it is
    assert label(None) == ""
