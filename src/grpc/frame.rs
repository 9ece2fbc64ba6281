//! Pre-encoded responses and the codec that writes them.
//!
//! A `SubscribeResponse` is a few per-subscriber fields (`index`, `event`) and a large shared
//! part (`selector`, `object`, `resource_version`, `uid`). Protobuf decodes a message from the
//! concatenation of its fields in any order, so the shared part is encoded once per update
//! ([`crate::registry::Update::wire`]) and each subscriber's frame is the two small fields
//! followed by those shared bytes. Clients decode it as an ordinary `SubscribeResponse`.

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

impl Frame {
    fn encode(&self, dst: &mut impl BufMut) {
        if self.index != 0 {
            prost::encoding::uint32::encode(1, &self.index, dst);
        }
        prost::encoding::int32::encode(3, &(self.event as i32), dst);
        dst.put_slice(&self.shared);
    }
}

/// Writes [`Frame`]s and reads `SubscribeRequest`s.
#[derive(Debug, Clone, Copy, Default)]
pub struct FrameCodec;

/// The encoder half of [`FrameCodec`].
#[derive(Debug, Clone, Copy, Default)]
pub struct FrameEncoder;

impl Encoder for FrameEncoder {
    type Item = Frame;
    type Error = Status;

    fn encode(&mut self, item: Frame, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        item.encode(dst);
        Ok(())
    }

    fn buffer_settings(&self) -> BufferSettings {
        BufferSettings::default()
    }
}

impl Codec for FrameCodec {
    type Encode = Frame;
    type Decode = pb::SubscribeRequest;
    type Encoder = FrameEncoder;
    type Decoder = ProstDecoder<pb::SubscribeRequest>;

    fn encoder(&mut self) -> FrameEncoder {
        FrameEncoder
    }

    fn decoder(&mut self) -> Self::Decoder {
        ProstDecoder::new(BufferSettings::default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pb::subscribe_response::Event;

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
            frame.encode(&mut buf);
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
        .encode(&mut buf);
        let decoded = pb::SubscribeResponse::decode(buf.as_slice()).unwrap();
        assert_eq!(
            (decoded.index, decoded.event(), decoded.selector.as_str()),
            (2, Event::Absent, "x.y.z/a/b")
        );
        assert!(decoded.object.is_empty() && decoded.uid.is_empty());
    }
}
