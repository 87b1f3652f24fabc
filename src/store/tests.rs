use super::*;

fn row(state: &str) -> ExistingRow<'_> {
    ExistingRow {
        state,
        fingerprint: &[7; 32],
        status: Some(201),
        headers: Some(
            StoredResponse {
                status: 201,
                headers: Vec::new(),
                body: Default::default(),
            }
            .encode_headers(),
        ),
        body: Some(b"ok".to_vec()),
        lease_expired: false,
        lease_remaining_ms: 1500,
        expires_in_ms: 60_000,
    }
}

fn at(key: &str) -> Option<(String, String)> {
    Some(("s".to_string(), key.to_string()))
}

#[test]
fn a_page_goes_on_after_its_last_key_or_its_last_row_or_ends() {
    let q = ListQuery {
        limit: 2,
        examine: 20,
        ..Default::default()
    };
    // Full of keys before its budget: after the last key, even with rows read past it.
    assert_eq!(
        ListPage::next_after(&q, 20, at("b"), at("z"), 2, false),
        at("b")
    );
    assert_eq!(
        ListPage::next_after(&q, 7, at("b"), at("g"), 2, false),
        at("b")
    );
    // Full, and its last key was the last row there is: the end.
    assert_eq!(ListPage::next_after(&q, 7, at("g"), at("g"), 2, true), None);
    // Full, on the last row of a spent budget: there may be more.
    assert_eq!(
        ListPage::next_after(&q, 20, at("z"), at("z"), 2, true),
        at("z")
    );
    // Budget spent with fewer keys (or none): after the last row read.
    assert_eq!(
        ListPage::next_after(&q, 20, at("c"), at("z"), 1, false),
        at("z")
    );
    assert_eq!(
        ListPage::next_after(&q, 20, None, at("z"), 0, false),
        at("z")
    );
    // Fewer rows than the budget, fewer keys than the limit: the walk ended.
    assert_eq!(
        ListPage::next_after(&q, 19, at("c"), at("y"), 1, false),
        None
    );
    assert_eq!(ListPage::next_after(&q, 0, None, None, 0, false), None);
}

#[test]
fn every_state_spelling_round_trips() {
    for s in [
        RowState::InFlight,
        RowState::Completed,
        RowState::NotReplayable,
        RowState::Unknown,
    ] {
        assert_eq!(RowState::parse(s.as_str()), Some(s));
    }
    assert_eq!(RowState::parse("claimed"), None);
}

#[test]
fn an_existing_row_decides_the_claim_the_same_for_both_stores() {
    let fp = [7u8; 32];
    assert!(matches!(
        row("completed").decide(&[8; 32]),
        Ok(Claim::Mismatch)
    ));
    match row("completed").decide(&fp) {
        Ok(Claim::Completed(r, left)) => {
            assert_eq!(
                (r.status, &r.body[..], left),
                (201, &b"ok"[..], Duration::from_secs(60))
            )
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        row("in_flight").decide(&fp),
        Ok(Claim::InFlight { lease_remaining }) if lease_remaining == Duration::from_millis(1500)
    ));
    let expired = ExistingRow {
        lease_expired: true,
        ..row("in_flight")
    };
    assert!(matches!(expired.decide(&fp), Ok(Claim::Held)));
    assert!(matches!(row("unknown").decide(&fp), Ok(Claim::Held)));
    assert!(matches!(
        row("not_replayable").decide(&fp),
        Ok(Claim::NotReplayable { status: 201 })
    ));
    // Rows that break the invariants are corrupt, never guessed at.
    assert!(matches!(
        row("bogus").decide(&fp),
        Err(StoreError::Corrupt(_))
    ));
    for broken in [
        ExistingRow {
            body: None,
            ..row("completed")
        },
        ExistingRow {
            headers: None,
            ..row("completed")
        },
        ExistingRow {
            status: Some(42),
            ..row("completed")
        },
        ExistingRow {
            status: None,
            ..row("not_replayable")
        },
    ] {
        assert!(matches!(broken.decide(&fp), Err(StoreError::Corrupt(_))));
    }
}
