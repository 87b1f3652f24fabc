use super::*;

#[test]
fn connection_named_headers_are_stripped() {
    let mut h = HeaderMap::new();
    h.insert("connection", "close, X-Secret".parse().unwrap());
    h.append("connection", "Keep-Alive,x-other".parse().unwrap());
    h.insert("x-secret", "1".parse().unwrap());
    h.insert("x-other", "1".parse().unwrap());
    // Named by the `close` option: RFC 9110 section 7.6.1 removes it too.
    h.insert("close", "1".parse().unwrap());
    h.insert("keep-alive", "timeout=5".parse().unwrap());
    h.insert("te", "trailers".parse().unwrap());
    h.insert("content-type", "text/plain".parse().unwrap());
    strip_hop_by_hop(&mut h);
    assert_eq!(h.len(), 1, "{h:?}");
    assert!(h.contains_key("content-type"));
}

#[test]
fn a_response_loses_hop_by_hop_and_gateway_only_headers_and_nothing_else() {
    let mut h = HeaderMap::new();
    h.insert("connection", "keep-alive, x-hop".parse().unwrap());
    h.insert("keep-alive", "timeout=5".parse().unwrap());
    h.insert("x-hop", "1".parse().unwrap());
    h.insert("transfer-encoding", "chunked".parse().unwrap());
    h.insert("idempotent-replayed", "true".parse().unwrap());
    h.insert("idempotency-status", "bypassed".parse().unwrap());
    h.insert("content-type", "application/json".parse().unwrap());
    h.append("set-cookie", "a=1".parse().unwrap());
    h.append("set-cookie", "b=2".parse().unwrap());
    clean_response_headers(&mut h);
    // Removing reorders the names (a field's own values keep their order).
    let mut left: Vec<_> = h
        .iter()
        .map(|(n, v)| (n.as_str(), v.to_str().unwrap()))
        .collect();
    left.sort();
    assert_eq!(
        left,
        [
            ("content-type", "application/json"),
            ("set-cookie", "a=1"),
            ("set-cookie", "b=2")
        ]
    );

    // The usual `Connection` values (any case) name nothing else; a second `Connection`
    // line naming a header still has it removed.
    for usual in ["keep-alive", "Close", "KEEP-ALIVE"] {
        let mut h = HeaderMap::new();
        h.insert("connection", usual.parse().unwrap());
        h.insert("keep-alive", "timeout=5".parse().unwrap());
        h.insert("x-kept", "1".parse().unwrap());
        clean_response_headers(&mut h);
        assert_eq!(h.keys().collect::<Vec<_>>(), ["x-kept"], "{usual}");
    }
    let mut h = HeaderMap::new();
    h.insert("connection", "keep-alive".parse().unwrap());
    h.append("connection", "x-hop".parse().unwrap());
    h.insert("x-hop", "1".parse().unwrap());
    h.insert("x-kept", "1".parse().unwrap());
    clean_response_headers(&mut h);
    assert_eq!(h.keys().collect::<Vec<_>>(), ["x-kept"]);

    // Without any of them every header stays, values in order.
    let mut plain = HeaderMap::new();
    plain.insert("content-type", "text/plain".parse().unwrap());
    plain.append("vary", "accept".parse().unwrap());
    plain.append("vary", "origin".parse().unwrap());
    let before = plain.clone();
    clean_response_headers(&mut plain);
    assert_eq!(plain, before);
}

#[test]
fn a_list_header_gets_this_hops_element_after_every_earlier_one() {
    let mut h = HeaderMap::new();
    let name = HeaderName::from_static("x-forwarded-for");
    assert_eq!(
        append_to_list(&h, &name, "192.0.2.7".into()).unwrap(),
        "192.0.2.7"
    );
    h.insert(&name, "198.51.100.1, 198.51.100.2".parse().unwrap());
    h.append(&name, "203.0.113.9".parse().unwrap());
    assert_eq!(
        append_to_list(&h, &name, "192.0.2.7".into()).unwrap(),
        "198.51.100.1, 198.51.100.2, 203.0.113.9, 192.0.2.7"
    );
}

#[test]
fn a_forwarded_element_quotes_what_is_not_a_token() {
    let v4 = ClientInfo::new("192.0.2.7:5000".parse().unwrap(), false);
    let host = HeaderValue::from_static("example.com");
    assert_eq!(
        forwarded_element(&v4, Some(&host)),
        "for=192.0.2.7;proto=http;host=example.com"
    );
    let v6 = ClientInfo::new("[2001:db8::1]:5000".parse().unwrap(), true);
    let host = HeaderValue::from_static("example.com:8443");
    assert_eq!(
        forwarded_element(&v6, Some(&host)),
        "for=\"[2001:db8::1]\";proto=https;host=\"example.com:8443\""
    );
    // An IPv4 client on a dual-stack listener is named as IPv4.
    let mapped = ClientInfo::new("[::ffff:192.0.2.7]:5000".parse().unwrap(), false);
    assert_eq!(forwarded_element(&mapped, None), "for=192.0.2.7;proto=http");
    let odd = HeaderValue::from_static("a\"b\\c");
    assert_eq!(
        forwarded_element(&v4, Some(&odd)),
        "for=192.0.2.7;proto=http;host=\"a\\\"b\\\\c\""
    );
    // Each is sized exactly, so it becomes a header value without a copy.
    let hosts = [
        "example.com",
        "example.com:8443",
        "a\"b\\c",
        "",
        "caf\u{e9}",
    ]
    .map(|h| HeaderValue::from_bytes(h.as_bytes()).unwrap());
    for client in [&v4, &v6, &mapped] {
        for host in hosts.iter().map(Some).chain([None]) {
            let e = forwarded_element(client, host);
            assert_eq!(e.capacity(), e.len(), "{e}");
            assert_eq!(owned_value(e.clone()).unwrap(), e.as_str());
        }
    }
}

#[test]
fn te_trailers_is_recognised_among_other_codings() {
    let mut h = HeaderMap::new();
    h.insert("te", "gzip, Trailers".parse().unwrap());
    assert!(accepts_trailers(&h));
    h.insert("te", "gzip".parse().unwrap());
    assert!(!accepts_trailers(&h));
}
