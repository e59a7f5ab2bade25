//! MQTT push (`mqtt://`, or `mqtts://` over TLS): a small MQTT 3.1.1 client (CONNECT, PUBLISH at QoS 1, PUBACK) — all a push needs, and
//! any broker speaks it. Each record is one PUBLISH of its JSON; records are acknowledged in order up
//! to the first one without a PUBACK. One connection per endpoint, reopened after any failure, with
//! a clean session: unacknowledged records stay in the queue and are published again.

use std::collections::HashMap;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};

use crate::dial::{Dialer, Stream};
use crate::endpoint::{EndpointError, Pushed};
use crate::record::Record;

/// Largest packet accepted from the endpoint broker (only CONNACK and PUBACK are expected).
const MAX_INBOUND_PACKET: usize = 64 * 1024;
const KEEP_ALIVE_S: u16 = 60;

pub struct MqttEndpoint {
    dialer: Dialer,
    topic: String,
    client_id: String,
    timeout: Duration,
    connection: Option<BufReader<Stream>>,
    next_packet_id: u16,
}

fn put_str(out: &mut Vec<u8>, text: &[u8]) {
    out.extend_from_slice(&(text.len().min(u16::MAX as usize) as u16).to_be_bytes());
    out.extend_from_slice(&text[..text.len().min(u16::MAX as usize)]);
}

/// Fixed header byte + remaining length + body.
fn packet(first: u8, body: &[u8]) -> Vec<u8> {
    let mut out = vec![first];
    let mut len = body.len();
    loop {
        let mut byte = (len % 128) as u8;
        len /= 128;
        if len > 0 {
            byte |= 0x80;
        }
        out.push(byte);
        if len == 0 {
            break;
        }
    }
    out.extend_from_slice(body);
    out
}

/// Writes and flushes: a TLS stream may hold written bytes until it is flushed.
async fn send(stream: &mut Stream, bytes: &[u8]) -> std::io::Result<()> {
    stream.write_all(bytes).await?;
    stream.flush().await
}

/// Reads one packet: (first byte, body).
async fn read_packet(stream: &mut BufReader<Stream>) -> Result<(u8, Vec<u8>), EndpointError> {
    let io = |e: std::io::Error| EndpointError::Io(e.to_string());
    let first = stream.read_u8().await.map_err(io)?;
    let mut len = 0usize;
    for shift in 0..4 {
        let byte = stream.read_u8().await.map_err(io)?;
        len |= usize::from(byte & 0x7f) << (7 * shift);
        if byte & 0x80 == 0 {
            break;
        }
        if shift == 3 {
            return Err(EndpointError::Io("malformed remaining length".into()));
        }
    }
    if len > MAX_INBOUND_PACKET {
        return Err(EndpointError::Io(format!("packet of {len} bytes")));
    }
    let mut body = vec![0; len];
    stream.read_exact(&mut body).await.map_err(io)?;
    Ok((first, body))
}

impl MqttEndpoint {
    pub(crate) fn new(
        dialer: Dialer,
        topic: String,
        client_id: String,
        timeout: Duration,
    ) -> MqttEndpoint {
        MqttEndpoint {
            dialer,
            topic,
            client_id,
            timeout,
            connection: None,
            next_packet_id: 1,
        }
    }

    pub(crate) async fn push(&mut self, records: &[Record]) -> Pushed {
        let mut acknowledged = 0;
        let result =
            tokio::time::timeout(self.timeout, self.publish_all(records, &mut acknowledged)).await;
        let error = match result {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(e),
            Err(_) => Some(EndpointError::Timeout(self.timeout)),
        };
        if error.is_some() {
            self.connection = None;
        }
        Pushed {
            acknowledged,
            error,
        }
    }

    async fn connect(&self) -> Result<BufReader<Stream>, EndpointError> {
        let connect_error = |reason: String| EndpointError::Connect {
            addr: self.dialer.authority.clone(),
            reason,
        };
        let mut stream = BufReader::new(self.dialer.connect().await?);
        let mut body = Vec::new();
        put_str(&mut body, b"MQTT");
        body.push(4); // 3.1.1
        body.push(0x02); // clean session
        body.extend_from_slice(&KEEP_ALIVE_S.to_be_bytes());
        put_str(&mut body, self.client_id.as_bytes());
        send(stream.get_mut(), &packet(0x10, &body))
            .await
            .map_err(|e| connect_error(e.to_string()))?;
        match read_packet(&mut stream).await? {
            (0x20, ack) if ack.len() == 2 && ack[1] == 0 => Ok(stream),
            (0x20, ack) => Err(connect_error(format!(
                "CONNACK return code {}",
                ack.get(1).copied().unwrap_or(255)
            ))),
            (first, _) => Err(connect_error(format!(
                "expected CONNACK, got packet {first:#x}"
            ))),
        }
    }

    fn packet_id(&mut self) -> u16 {
        let id = self.next_packet_id;
        self.next_packet_id = self.next_packet_id.checked_add(1).unwrap_or(1);
        id
    }

    async fn publish_all(
        &mut self,
        records: &[Record],
        acknowledged: &mut usize,
    ) -> Result<(), EndpointError> {
        let mut stream = match self.connection.take() {
            Some(stream) => stream,
            None => self.connect().await?,
        };
        // Pipelined: every PUBLISH goes out, then the PUBACKs are matched to them.
        let mut out = Vec::new();
        let mut index_of = HashMap::new();
        for (i, record) in records.iter().enumerate() {
            let id = self.packet_id();
            index_of.insert(id, i);
            let mut body = Vec::new();
            put_str(&mut body, self.topic.as_bytes());
            body.extend_from_slice(&id.to_be_bytes());
            body.extend_from_slice(&record.to_json());
            out.extend_from_slice(&packet(0x32, &body));
        }
        send(stream.get_mut(), &out)
            .await
            .map_err(|e| EndpointError::Io(e.to_string()))?;
        let mut acked = vec![false; records.len()];
        while *acknowledged < records.len() {
            match read_packet(&mut stream).await? {
                (0x40, body) if body.len() >= 2 => {
                    let id = u16::from_be_bytes([body[0], body[1]]);
                    if let Some(&i) = index_of.get(&id) {
                        acked[i] = true;
                    }
                    while *acknowledged < records.len() && acked[*acknowledged] {
                        *acknowledged += 1;
                    }
                }
                (0xd0, _) => {} // PINGRESP
                (first, _) => {
                    return Err(EndpointError::Io(format!(
                        "unexpected packet {first:#x} from the endpoint broker"
                    )))
                }
            }
        }
        self.connection = Some(stream);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remaining_length_is_a_varint() {
        assert_eq!(packet(0x40, &[0, 1]), vec![0x40, 2, 0, 1]);
        let long = packet(0x30, &[0; 200]);
        assert_eq!(&long[..3], &[0x30, 0xc8, 0x01]);
    }
}
