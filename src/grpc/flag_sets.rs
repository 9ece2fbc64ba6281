//! A set of FeatureFlags as flagd reads it: their flags merged into one configuration, and, for
//! a client that takes incremental updates, the same flags split into flag sets, each sent
//! again only when it changes.
//!
//! flagd's incremental updates (experimental, flagd#1922: a source with `incrementalUpdates`)
//! change how a configuration replaces the one before: only the flags of the flag sets
//! (`flagSetId`s) it names are replaced, and every other flag set is kept. So each FeatureFlag of
//! a set can be sent alone when it changes, and an empty configuration naming a flag set in its
//! `metadata` removes that flag set. A flag's flag set is its own `metadata.flagSetId`, else its
//! FeatureFlag's `spec.flagSpec.metadata.flagSetId`, else `<namespace>/<name>` of its
//! FeatureFlag; every flag sent this way names its flag set in its own metadata, so one message
//! can carry several.

use std::collections::BTreeMap;
use std::hash::{DefaultHasher, Hasher};
use std::sync::{Arc, OnceLock};

use serde_json::Value;
use serde_json::value::RawValue;

/// What a merge reads of one FeatureFlag: its namespace, its flag set, and each of its flags
/// and `$evaluators` as written (JSON kept as text, not rebuilt). Decoded once per state of the
/// FeatureFlag ([`crate::registry::Update::decoded`]), so a change to one member of a large set
/// costs its own decoding, not every member's.
#[derive(Debug, Default)]
pub struct MemberSpec {
    namespace: String,
    /// The flag set of its flags that name none.
    flag_set: String,
    flags: Vec<(String, Box<RawValue>)>,
    evaluators: Vec<(String, Box<RawValue>)>,
    /// Each flag's flag set and its JSON naming it, made the first time an incremental client
    /// needs them.
    placed: OnceLock<Vec<(String, String)>>,
}

impl MemberSpec {
    /// The spec of the FeatureFlag `object`; none of its flags if they do not parse.
    pub fn of(object: &crate::source::Object) -> MemberSpec {
        #[derive(serde::Deserialize, Default)]
        struct Document {
            #[serde(default)]
            metadata: Metadata,
            #[serde(default)]
            spec: Option<FeatureFlagSpec>,
        }
        #[derive(serde::Deserialize, Default)]
        struct Metadata {
            #[serde(default)]
            namespace: String,
            #[serde(default)]
            name: String,
        }
        #[derive(serde::Deserialize)]
        struct FeatureFlagSpec {
            #[serde(rename = "flagSpec", default)]
            flag_spec: Option<FlagSpec>,
        }
        #[derive(serde::Deserialize)]
        struct FlagSpec {
            #[serde(default)]
            flags: Option<BTreeMap<String, Box<RawValue>>>,
            #[serde(rename = "$evaluators", default)]
            evaluators: Option<BTreeMap<String, Box<RawValue>>>,
            #[serde(default)]
            metadata: Option<Value>,
        }
        let document: Document = serde_json::from_slice(&object.json).unwrap_or_default();
        let spec = document.spec.and_then(|s| s.flag_spec);
        let named = spec
            .as_ref()
            .and_then(|s| s.metadata.as_ref())
            .and_then(flag_set_of);
        let Metadata { namespace, name } = document.metadata;
        let flag_set = named.unwrap_or_else(|| format!("{namespace}/{name}"));
        let (flags, evaluators) = spec.map_or((None, None), |s| (s.flags, s.evaluators));
        MemberSpec {
            namespace,
            flag_set,
            flags: flags.into_iter().flatten().collect(),
            evaluators: evaluators.into_iter().flatten().collect(),
            placed: OnceLock::new(),
        }
    }

    /// Each flag's flag set and JSON naming it in `metadata.flagSetId`.
    fn placed(&self) -> &[(String, String)] {
        self.placed.get_or_init(|| {
            let place = |raw: &RawValue| -> (String, String) {
                let mut flag: Value = match serde_json::from_str(raw.get()) {
                    Ok(flag @ Value::Object(_)) => flag,
                    // Not a flag: sent as written, for flagd to refuse.
                    _ => return (self.flag_set.clone(), raw.get().to_string()),
                };
                if let Some(own) = flag.get("metadata").and_then(flag_set_of) {
                    return (own, raw.get().to_string());
                }
                let metadata = flag
                    .as_object_mut()
                    .expect("an object")
                    .entry("metadata")
                    .or_insert_with(|| Value::Object(Default::default()));
                if let Some(metadata) = metadata.as_object_mut() {
                    metadata.insert("flagSetId".into(), self.flag_set.clone().into());
                }
                (self.flag_set.clone(), flag.to_string())
            };
            self.flags.iter().map(|(_, raw)| place(raw)).collect()
        })
    }
}

/// The `flagSetId` a `metadata` object names, if it names one.
fn flag_set_of(metadata: &Value) -> Option<String> {
    metadata
        .get("flagSetId")
        .and_then(Value::as_str)
        .map(str::to_string)
}

/// The flags of a set's FeatureFlags, given in name order (namespace, then name, for a set of
/// every namespace), merged: each flag key (and `$evaluators` key) from the first FeatureFlag
/// of its namespace that defines it; the keys defined again. A key that FeatureFlags of two
/// namespaces define is served from neither: no namespace may shadow another's flag by sorting
/// first. Made once per state of the set, whatever the number of its subscribers or how they
/// take it.
#[derive(Debug)]
pub struct Merge {
    members: Vec<Arc<MemberSpec>>,
    /// The flags served, in key order: which member, which of its flags.
    flags: Vec<(usize, usize)>,
    /// The `$evaluators` served, in key order.
    evaluators: Vec<(usize, usize)>,
    /// The keys defined more than once.
    conflicts: Vec<String>,
    /// The served flags by flag set, made the first time an incremental client needs them.
    flag_sets: OnceLock<FlagSets>,
}

impl Merge {
    /// The merge of `members`, in name order.
    pub fn of(members: Vec<Arc<MemberSpec>>) -> Merge {
        // Each key: the member that defined it first, which of its entries, and whether a
        // member of another namespace defines it too.
        type Served<'s> = BTreeMap<&'s str, (usize, usize, bool)>;
        let mut flags: Served = BTreeMap::new();
        let mut evaluators: Served = BTreeMap::new();
        let mut conflicts = Vec::new();
        for (m, spec) in members.iter().enumerate() {
            for (field, from, into) in [
                ("flags", &spec.flags, &mut flags),
                ("$evaluators", &spec.evaluators, &mut evaluators),
            ] {
                for (i, (key, _)) in from.iter().enumerate() {
                    match into.get_mut(key.as_str()) {
                        None => {
                            into.insert(key, (m, i, false));
                        }
                        Some((first, _, _)) if members[*first].namespace == spec.namespace => {
                            conflicts.push(format!("{field}.{key}"));
                        }
                        Some((first, _, across)) => {
                            conflicts.push(format!(
                                "{field}.{key} (in {} and {}: served from neither)",
                                members[*first].namespace, spec.namespace
                            ));
                            *across = true;
                        }
                    }
                }
            }
        }
        let served = |merged: Served| -> Vec<(usize, usize)> {
            merged
                .into_values()
                .filter(|(_, _, across)| !across)
                .map(|(m, i, _)| (m, i))
                .collect()
        };
        let (flags, evaluators) = (served(flags), served(evaluators));
        Merge {
            members,
            flags,
            evaluators,
            conflicts,
            flag_sets: OnceLock::new(),
        }
    }

    /// The keys defined more than once, as `flags.<key>` or `$evaluators.<key>` (with the two
    /// namespaces when they differ).
    pub fn conflicts(&self) -> &[String] {
        &self.conflicts
    }

    /// The merged configuration: `{"flags": …, "$evaluators"?: …}`.
    pub fn configuration(&self) -> String {
        let mut config = String::from("{\"flags\":");
        object(&mut config, self.entries(&self.flags, |s| &s.flags));
        if !self.evaluators.is_empty() {
            config.push_str(",\"$evaluators\":");
            object(&mut config, self.evaluators());
        }
        config.push('}');
        config
    }

    fn entries<'a>(
        &'a self,
        which: &'a [(usize, usize)],
        field: impl Fn(&MemberSpec) -> &Vec<(String, Box<RawValue>)> + 'a,
    ) -> impl Iterator<Item = (&'a str, &'a str)> + 'a {
        which.iter().map(move |&(m, i)| {
            let (key, value) = &field(&self.members[m])[i];
            (key.as_str(), value.get())
        })
    }

    fn evaluators(&self) -> impl Iterator<Item = (&str, &str)> {
        self.entries(&self.evaluators, |s| &s.evaluators)
    }

    /// The served flags by flag set.
    pub fn flag_sets(&self) -> &FlagSets {
        self.flag_sets.get_or_init(|| {
            let mut evaluators = String::new();
            if !self.evaluators.is_empty() {
                evaluators.push_str("\"$evaluators\":");
                object(&mut evaluators, self.evaluators());
            }
            let mut sets: BTreeMap<String, String> = BTreeMap::new();
            for &(m, i) in &self.flags {
                let member = &self.members[m];
                let (flag_set, json) = &member.placed()[i];
                let entries = sets.entry(flag_set.clone()).or_default();
                if !entries.is_empty() {
                    entries.push(',');
                }
                entry(entries, &member.flags[i].0, json);
            }
            let sets = sets
                .into_iter()
                .map(|(id, entries)| {
                    let mut h = DefaultHasher::new();
                    h.write(entries.as_bytes());
                    h.write(evaluators.as_bytes());
                    let digest = h.finish();
                    (id, FlagSet { entries, digest })
                })
                .collect();
            FlagSets { sets, evaluators }
        })
    }
}

/// `{"key":value,…}` of `entries` (values as JSON text), appended to `text`.
fn object<'a>(text: &mut String, entries: impl Iterator<Item = (&'a str, &'a str)>) {
    text.push('{');
    for (n, (key, value)) in entries.enumerate() {
        if n > 0 {
            text.push(',');
        }
        entry(text, key, value);
    }
    text.push('}');
}

fn entry(text: &mut String, key: &str, value: &str) {
    text.push_str(&Value::from(key).to_string());
    text.push(':');
    text.push_str(value);
}

/// A set's served flags by flag set, with the `$evaluators` every message carries (flagd
/// resolves a flag's `$ref`s within the message that brings it).
#[derive(Debug)]
pub struct FlagSets {
    sets: BTreeMap<String, FlagSet>,
    /// `"$evaluators":{…}`, or nothing.
    evaluators: String,
}

/// The flags of one flag set: `"key":{…}` entries, and a digest of them and the evaluators.
#[derive(Debug)]
struct FlagSet {
    entries: String,
    digest: u64,
}

/// What one incremental client holds: each flag set as last sent to it.
#[derive(Debug, Default)]
pub struct Held {
    sent: BTreeMap<String, u64>,
    started: bool,
}

impl Held {
    /// The configurations that bring this client from what it holds to `now`: an empty one
    /// naming each flag set that is gone (the last of them named by the main one), and one
    /// with every flag set that changed; nothing when nothing did. The first call always
    /// gives one configuration, `{"flags":{}}` for a set with no flags.
    pub fn next(&mut self, now: &FlagSets) -> Vec<String> {
        let changed: Vec<(&String, &FlagSet)> = now
            .sets
            .iter()
            .filter(|(id, set)| self.sent.get(*id) != Some(&set.digest))
            .collect();
        let mut gone: Vec<String> = self
            .sent
            .keys()
            .filter(|id| !now.sets.contains_key(*id))
            .cloned()
            .collect();
        let first = !std::mem::replace(&mut self.started, true);
        if changed.is_empty() && gone.is_empty() && !first {
            return Vec::new();
        }
        let last_gone = gone.pop();
        let mut out: Vec<String> = gone
            .into_iter()
            .map(|id| {
                self.sent.remove(&id);
                removal(&id, "")
            })
            .collect();
        let mut config = String::from("{\"flags\":{");
        for (n, (id, set)) in changed.iter().enumerate() {
            if n > 0 {
                config.push(',');
            }
            config.push_str(&set.entries);
            self.sent.insert((*id).clone(), set.digest);
        }
        config.push('}');
        if !changed.is_empty() && !now.evaluators.is_empty() {
            config.push(',');
            config.push_str(&now.evaluators);
        }
        match last_gone {
            Some(id) => {
                self.sent.remove(&id);
                out.push(removal(&id, &config[1..]));
            }
            None => {
                config.push('}');
                out.push(config);
            }
        }
        out
    }
}

/// A configuration naming flag set `id` in its metadata, with `body` (`"flags":{…},…`, or
/// nothing for no flags) before it.
fn removal(id: &str, body: &str) -> String {
    let body = if body.is_empty() {
        "\"flags\":{}"
    } else {
        body
    };
    format!(
        "{{{body},\"metadata\":{{\"flagSetId\":{}}}}}",
        Value::from(id)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn member(namespace: &str, name: &str, flag_spec: Value) -> Arc<MemberSpec> {
        let object = json!({
            "metadata": { "name": name, "namespace": namespace },
            "spec": { "flagSpec": flag_spec },
        });
        Arc::new(MemberSpec::of(&crate::source::Object::from_value(&object)))
    }

    fn flags(namespace: &str, flags: Value) -> Arc<MemberSpec> {
        member(
            namespace,
            "f",
            json!({ "flags": flags, "$evaluators": { "e": { "in": [1] } } }),
        )
    }

    #[test]
    fn a_merge_keeps_a_namespaces_first_definition_and_serves_no_key_two_namespaces_define() {
        let specs = vec![
            flags("team-a", json!({ "x": { "v": 1 }, "y": { "v": 1 } })),
            flags("team-a", json!({ "y": { "v": 2 }, "z": { "v": 2 } })),
            flags("team-b", json!({ "z": { "v": 3 }, "w": { "v": 3 } })),
        ];
        let merge = Merge::of(specs.clone());
        let config: Value = serde_json::from_str(&merge.configuration()).unwrap();
        assert_eq!(
            config["flags"],
            json!({ "w": { "v": 3 }, "x": { "v": 1 }, "y": { "v": 1 } }),
            "y from team-a's first; z, in both namespaces, from neither"
        );
        assert_eq!(
            merge.conflicts(),
            [
                "flags.y",
                "$evaluators.e",
                "flags.z (in team-a and team-b: served from neither)",
                "$evaluators.e (in team-a and team-b: served from neither)",
            ]
        );
        assert!(config.get("$evaluators").is_none(), "{config}");
        // One namespace: as before, the first in name order.
        let config: Value =
            serde_json::from_str(&Merge::of(specs[..2].to_vec()).configuration()).unwrap();
        assert_eq!(config["flags"]["y"]["v"], 1);
        assert_eq!(config["$evaluators"]["e"]["in"][0], 1);
    }

    fn parsed(configs: Vec<String>) -> Vec<Value> {
        configs
            .iter()
            .map(|c| serde_json::from_str(c).unwrap())
            .collect()
    }

    #[test]
    fn each_flag_names_its_flag_set_its_own_its_feature_flags_or_the_feature_flags_name() {
        let members = vec![
            member(
                "ns",
                "a",
                json!({ "flags": { "x": { "v": 1 }, "o": { "v": 0, "metadata": { "flagSetId": "own", "k": 1 } } } }),
            ),
            member(
                "ns",
                "b",
                json!({ "flags": { "y": { "v": 2, "metadata": { "k": 2 } } }, "metadata": { "flagSetId": "team-b" } }),
            ),
        ];
        let merge = Merge::of(members);
        let first = parsed(Held::default().next(merge.flag_sets()));
        assert_eq!(
            first,
            [json!({ "flags": {
                "o": { "v": 0, "metadata": { "flagSetId": "own", "k": 1 } },
                "x": { "v": 1, "metadata": { "flagSetId": "ns/a" } },
                "y": { "v": 2, "metadata": { "flagSetId": "team-b", "k": 2 } },
            } })]
        );
    }

    #[test]
    fn only_the_flag_sets_that_changed_are_sent_and_a_gone_one_is_named_empty() {
        let a = |v: u32| member("ns", "a", json!({ "flags": { "x": { "v": v } } }));
        let b = |v: u32| member("ns", "b", json!({ "flags": { "y": { "v": v } } }));
        let c = member("ns", "c", json!({ "flags": { "z": { "v": 0 } } }));
        let mut held = Held::default();
        let sets = |members: Vec<Arc<MemberSpec>>| Merge::of(members);

        let all = parsed(held.next(sets(vec![a(1), b(1), c.clone()]).flag_sets()));
        assert_eq!(all.len(), 1);
        assert_eq!(all[0]["flags"].as_object().unwrap().len(), 3);
        assert!(
            held.next(sets(vec![a(1), b(1), c.clone()]).flag_sets())
                .is_empty(),
            "nothing changed"
        );

        let one = parsed(held.next(sets(vec![a(2), b(1), c.clone()]).flag_sets()));
        assert_eq!(
            one,
            [json!({ "flags": { "x": { "v": 2, "metadata": { "flagSetId": "ns/a" } } } })]
        );

        // b and c leave while a changes: one removal alone, the other with a's flags.
        let gone = parsed(held.next(sets(vec![a(3)]).flag_sets()));
        assert_eq!(
            gone,
            [
                json!({ "flags": {}, "metadata": { "flagSetId": "ns/b" } }),
                json!({ "flags": { "x": { "v": 3, "metadata": { "flagSetId": "ns/a" } } }, "metadata": { "flagSetId": "ns/c" } }),
            ]
        );
        let empty = parsed(held.next(sets(vec![]).flag_sets()));
        assert_eq!(
            empty,
            [json!({ "flags": {}, "metadata": { "flagSetId": "ns/a" } })]
        );
        assert_eq!(
            parsed(Held::default().next(sets(vec![]).flag_sets())),
            [json!({ "flags": {} })],
            "a first message even for no flags"
        );
    }

    #[test]
    fn an_evaluator_that_changes_sends_every_flag_set_again_with_it() {
        let spec = |e: u32| {
            vec![
                member(
                    "ns",
                    "a",
                    json!({ "flags": { "x": {} }, "$evaluators": { "e": { "in": [e] } } }),
                ),
                member("ns", "b", json!({ "flags": { "y": {} } })),
            ]
        };
        let mut held = Held::default();
        held.next(Merge::of(spec(1)).flag_sets());
        let again = parsed(held.next(Merge::of(spec(2)).flag_sets()));
        assert_eq!(again.len(), 1);
        assert_eq!(again[0]["flags"].as_object().unwrap().len(), 2);
        assert_eq!(again[0]["$evaluators"], json!({ "e": { "in": [2] } }));
    }

    /// flagd's store under incremental updates (core/pkg/store/store.go, `Update`): flags by
    /// flag set and key; a configuration replaces the flags of each flag set it names (in its
    /// metadata or a flag's) and keeps the rest.
    #[derive(Default)]
    struct Store(BTreeMap<(Option<String>, String), Value>);

    impl Store {
        fn update(&mut self, config: &str) {
            let config: Value = serde_json::from_str(config).unwrap();
            let set_of = |flag: &Value| flag["metadata"]["flagSetId"].as_str().map(str::to_string);
            let new: BTreeMap<(Option<String>, String), Value> = config["flags"]
                .as_object()
                .unwrap()
                .iter()
                .map(|(key, flag)| ((set_of(flag), key.clone()), flag.clone()))
                .collect();
            let mut named: Vec<Option<String>> = new.keys().map(|(set, _)| set.clone()).collect();
            if let Some(id) = config["metadata"]["flagSetId"].as_str() {
                named.push(Some(id.to_string()));
            }
            self.0
                .retain(|id, _| !named.contains(&id.0) || new.contains_key(id));
            self.0.extend(new);
        }

        /// The flags held by key, without the flag sets they name; `None` if a key is held twice.
        fn flags(&self) -> Option<Value> {
            let mut flags = serde_json::Map::new();
            for ((_, key), flag) in &self.0 {
                if flags.insert(key.clone(), unnamed(flag)).is_some() {
                    return None;
                }
            }
            Some(Value::Object(flags))
        }
    }

    /// `flag` without the flag set it names.
    fn unnamed(flag: &Value) -> Value {
        let mut flag = flag.clone();
        if let Some(metadata) = flag.get_mut("metadata").and_then(Value::as_object_mut) {
            metadata.remove("flagSetId");
            if metadata.is_empty() {
                flag.as_object_mut().unwrap().remove("metadata");
            }
        }
        flag
    }

    /// A FeatureFlag of a few keys, maybe naming a flag set, maybe a flag naming its own, from
    /// small pools so that keys and flag sets collide.
    fn arbitrary_member() -> impl proptest::strategy::Strategy<Value = (String, Value)> {
        use proptest::prelude::*;
        let flag = (0..3u8, proptest::option::of(0..3u8)).prop_map(|(v, own)| match own {
            Some(own) => json!({ "v": v, "metadata": { "flagSetId": format!("s{own}") } }),
            None => json!({ "v": v }),
        });
        (
            0..2u8,
            0..4u8,
            proptest::collection::btree_map("k[0-4]", flag, 0..4),
            proptest::option::of(0..3u8),
        )
            .prop_map(|(ns, name, flags, set)| {
                let mut spec = json!({ "flags": flags });
                if let Some(set) = set {
                    spec["metadata"] = json!({ "flagSetId": format!("s{set}") });
                }
                (format!("ns{ns}/ff{name}"), spec)
            })
    }

    proptest::proptest! {
        /// Whatever the sets' states, a client that applies each incremental update as flagd's
        /// store does holds what the whole configuration would give, with no key twice.
        #[test]
        fn incremental_updates_bring_flagds_store_to_the_whole_configuration(
            states in proptest::collection::vec(proptest::collection::vec(arbitrary_member(), 0..6), 1..8)
        ) {
            let mut held = Held::default();
            let mut store = Store::default();
            for state in states {
                // The set's members by namespace and name, as the registry keeps them.
                let members: BTreeMap<String, Value> = state.into_iter().collect();
                let specs = members
                    .iter()
                    .map(|(id, spec)| {
                        let (ns, name) = id.split_once('/').unwrap();
                        member(ns, name, spec.clone())
                    })
                    .collect();
                let merge = Merge::of(specs);
                for config in held.next(merge.flag_sets()) {
                    store.update(&config);
                }
                let whole: Value = serde_json::from_str(&merge.configuration()).unwrap();
                let whole: serde_json::Map<String, Value> = whole["flags"]
                    .as_object()
                    .unwrap()
                    .iter()
                    .map(|(key, flag)| (key.clone(), unnamed(flag)))
                    .collect();
                proptest::prop_assert_eq!(store.flags(), Some(Value::Object(whole)));
            }
        }
    }

    #[test]
    fn a_key_that_moves_to_another_flag_set_leaves_the_old_one_in_the_same_message() {
        // y is defined by a and b of one namespace: a's is served until a drops it.
        let a = |with_y: bool| {
            let flags = if with_y {
                json!({ "x": {}, "y": { "v": "a" } })
            } else {
                json!({ "x": {} })
            };
            member("ns", "a", json!({ "flags": flags }))
        };
        let b = member("ns", "b", json!({ "flags": { "y": { "v": "b" } } }));
        let mut held = Held::default();
        held.next(Merge::of(vec![a(true), b.clone()]).flag_sets());
        let moved = parsed(held.next(Merge::of(vec![a(false), b]).flag_sets()));
        assert_eq!(moved.len(), 1, "{moved:?}");
        assert_eq!(
            moved[0]["flags"],
            json!({
                "x": { "metadata": { "flagSetId": "ns/a" } },
                "y": { "v": "b", "metadata": { "flagSetId": "ns/b" } },
            })
        );
    }
}
