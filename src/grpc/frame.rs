//! Pre-encoded responses and the codec that writes them (ADR 0007).
//!
//! A `SubscribeResponse` is a few per-subscriber fields (`index`, `event`) and a large shared
//! part (`selector`, `object`, `resource_version`, `uid`). Protobuf decodes a message from the
//! concatenation of its fields in any order, so the shared part is encoded once per update
//! ([`crate::registry::Update::wire`]) and each subscriber's frame is the two small fields
//! followed by those shared bytes. Clients decode it as an ordinary `SubscribeResponse`. A flagd
//! `SyncFlagsResponse` has no per-subscriber fields at all: it is sent as [`Encoded`] bytes.

use std::marker::PhantomData;

use bytes::{BufMut, Bytes};
use prost::Message;
use tonic::Status;
use tonic::codec::{BufferSettings, Codec, EncodeBuf, Encoder};
use tonic_prost::ProstDecoder;

use crate::pb;
use crate::source::Object;

/// One response on a Subscribe stream, ready to write.
#[derive(Debug, Clone, PartialEq)]
pub struct Frame {
    /// `SubscribeResponse.index`.
    pub index: u32,
    /// `SubscribeResponse.event`.
    pub event: pb::subscribe_response::Event,
    /// The encoded shared fields.
    pub shared: Bytes,
}

/// The shared fields of a response about an object: selector, object, resourceVersion, uid.
pub fn encode_object(selector: &str, object: &Object) -> Bytes {
    pb::SubscribeResponse {
        selector: selector.to_string(),
        object: object.json.clone(),
        resource_version: object.resource_version.clone(),
        uid: object.uid.clone(),
        ..Default::default()
    }
    .encode_to_vec()
    .into()
}

/// The shared fields of an ABSENT response: the selector alone.
pub fn encode_absent(selector: &str) -> Bytes {
    pb::SubscribeResponse {
        selector: selector.to_string(),
        ..Default::default()
    }
    .encode_to_vec()
    .into()
}

/// The shared fields of a CURRENT response: the selector, and the version the client holds.
pub fn encode_current(selector: &str, object: &Object) -> Bytes {
    pb::SubscribeResponse {
        selector: selector.to_string(),
        resource_version: object.resource_version.clone(),
        uid: object.uid.clone(),
        ..Default::default()
    }
    .encode_to_vec()
    .into()
}

/// The shared fields of a set's SYNCED response: the set's selector and its members' version.
pub fn encode_synced(selector: &str, set_version: String) -> Bytes {
    pb::SubscribeResponse {
        selector: selector.to_string(),
        set_version,
        ..Default::default()
    }
    .encode_to_vec()
    .into()
}

/// The shared fields of a FAILED response: the selector and the status.
pub fn encode_failed(selector: &str, status: &tonic::Status) -> Bytes {
    pb::SubscribeResponse {
        selector: selector.to_string(),
        error_code: status.code() as i32,
        error_message: status.message().to_string(),
        ..Default::default()
    }
    .encode_to_vec()
    .into()
}

/// A whole message, already encoded.
#[derive(Debug, Clone, PartialEq)]
pub struct Encoded(pub Bytes);

/// A response made of this subscriber's own fields (the head) followed by a part encoded once
/// for every subscriber. [`crate::grpc::wire`] sends a large shared part without copying it. The
/// [`FrameCodec`], which the generated servers need and the load harness's bare server writes
/// through, copies both.
pub trait WriteFrame: Send + 'static {
    /// Writes this subscriber's own fields.
    fn write_head(&self, dst: &mut impl BufMut);

    /// An upper bound of the head's encoded length.
    fn head_len_hint(&self) -> usize;

    /// The shared part, already encoded.
    fn shared(&self) -> &Bytes;

    /// Writes the whole message.
    fn write(&self, dst: &mut impl BufMut) {
        self.write_head(dst);
        dst.put_slice(self.shared());
    }

    /// An upper bound of the whole message's encoded length.
    fn len_hint(&self) -> usize {
        self.head_len_hint() + self.shared().len()
    }
}

impl WriteFrame for Frame {
    fn write_head(&self, dst: &mut impl BufMut) {
        if self.index != 0 {
            prost::encoding::uint32::encode(1, &self.index, dst);
        }
        prost::encoding::int32::encode(3, &(self.event as i32), dst);
    }

    fn head_len_hint(&self) -> usize {
        // Two tagged varints: at most 1 + 5 (u32) and 1 + 10 (a negative i32).
        17
    }

    fn shared(&self) -> &Bytes {
        &self.shared
    }
}

impl WriteFrame for Encoded {
    fn write_head(&self, _dst: &mut impl BufMut) {}

    fn head_len_hint(&self) -> usize {
        0
    }

    fn shared(&self) -> &Bytes {
        &self.0
    }
}

/// Each stream keeps its buffers for life. tonic's default allocates 8 KiB up front, a quarter
/// of an idle sidecar's cost; frames are reserved at their exact size instead, so the initial
/// buffer can be small (not zero: tonic's compression divides by it).
pub(crate) fn stream_buffers() -> BufferSettings {
    BufferSettings::new(256, 32 * 1024)
}

/// Writes pre-encoded responses `E` and reads requests `D` with prost.
#[derive(Debug)]
pub struct FrameCodec<E, D>(PhantomData<fn() -> (E, D)>);

impl<E, D> Default for FrameCodec<E, D> {
    fn default() -> Self {
        FrameCodec(PhantomData)
    }
}

/// The encoder half of [`FrameCodec`].
#[derive(Debug)]
pub struct FrameEncoder<E>(PhantomData<fn() -> E>);

impl<E: WriteFrame> Encoder for FrameEncoder<E> {
    type Item = E;
    type Error = Status;

    fn encode(&mut self, item: E, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.reserve(item.len_hint());
        item.write(dst);
        Ok(())
    }

    fn buffer_settings(&self) -> BufferSettings {
        stream_buffers()
    }
}

impl<E: WriteFrame, D: prost::Message + Default + Send + 'static> Codec for FrameCodec<E, D> {
    type Encode = E;
    type Decode = D;
    type Encoder = FrameEncoder<E>;
    type Decoder = ProstDecoder<D>;

    fn encoder(&mut self) -> FrameEncoder<E> {
        FrameEncoder(PhantomData)
    }

    fn decoder(&mut self) -> Self::Decoder {
        ProstDecoder::new(stream_buffers())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pb::subscribe_response::Event;

    #[test]
    fn the_length_hint_covers_every_frame() {
        let shared = Bytes::from(vec![7u8; 1000]);
        for index in [0, 1, 127, 128, u32::MAX] {
            for event in [
                Event::Snapshot,
                Event::Updated,
                Event::Deleted,
                Event::Absent,
            ] {
                let frame = Frame {
                    index,
                    event,
                    shared: shared.clone(),
                };
                let mut buf = Vec::new();
                frame.write(&mut buf);
                assert!(buf.len() <= frame.len_hint(), "{index} {event:?}");
            }
        }
        let encoded = Encoded(shared.clone());
        let mut buf = Vec::new();
        encoded.write(&mut buf);
        assert_eq!(buf.len(), encoded.len_hint());
    }

    #[test]
    fn a_frame_decodes_as_an_ordinary_response() {
        let object = Object {
            json: Bytes::from_static(br#"{"kind":"FeatureFlag"}"#),
            uid: "u-1".into(),
            resource_version: "105".into(),
        };
        let shared = encode_object(
            "featureflags.v1beta1.core.openfeature.dev/default/demo",
            &object,
        );
        for (index, event) in [
            (0, Event::Snapshot),
            (7, Event::Updated),
            (300, Event::Deleted),
        ] {
            let frame = Frame {
                index,
                event,
                shared: shared.clone(),
            };
            let mut buf = Vec::new();
            frame.write(&mut buf);
            let decoded = pb::SubscribeResponse::decode(buf.as_slice()).unwrap();
            assert_eq!(decoded.index, index);
            assert_eq!(decoded.event(), event);
            assert_eq!(
                decoded.selector,
                "featureflags.v1beta1.core.openfeature.dev/default/demo"
            );
            assert_eq!(decoded.object, object.json);
            assert_eq!(decoded.resource_version, "105");
            assert_eq!(decoded.uid, "u-1");
        }
        let mut buf = Vec::new();
        Frame {
            index: 2,
            event: Event::Absent,
            shared: encode_absent("x.y.z/a/b"),
        }
        .write(&mut buf);
        let decoded = pb::SubscribeResponse::decode(buf.as_slice()).unwrap();
        assert_eq!(
            (decoded.index, decoded.event(), decoded.selector.as_str()),
            (2, Event::Absent, "x.y.z/a/b")
        );
        assert!(decoded.object.is_empty() && decoded.uid.is_empty());
    }
}
